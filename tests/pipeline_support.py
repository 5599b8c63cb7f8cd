"""Helpers for the data-pipeline tests: small corpora and running the scripts."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the command-line tools of the pipeline, as modules of this interpreter
PIPELINE_COMMANDS = {"tpp-prepare-corpus": "tpp_pipeline.pipeline",
                     "tpp-prepare-wmt14": "tpp_pipeline.wmt14"}

ENGLISH = [
    "Barack Obama visited Paris on Monday.",
    "The well-known author didn't say \"hello\" & left early.",
    "Prices rose 3.5% to $1,200 in 2013, analysts said.",
    "See https://example.com/a-b?x=1 for the full report.",
    "Müller travelled to Zürich — a naïve café owner greeted him.",
    "Angela Merkel met Emmanuel Macron in Berlin yesterday.",
    "The committee's decision wasn't final, but it was clear.",
    "Apple and Microsoft reported record profits last year.",
    "A [bracketed] <tag> | pipe and O'Brien's rock-'n'-roll.",
    "We walked 12 km along the river before it started raining.",
    "The European Parliament adopted the resolution by 420 votes to 95.",
    "Her brother-in-law works at the United Nations in New York.",
]
GERMAN = [
    "Barack Obama besuchte Paris am Montag.",
    "Der bekannte Autor sagte nicht \"hallo\" & ging früh.",
    "Die Preise stiegen 2013 um 3,5 % auf 1.200 $, sagten Analysten.",
    "Siehe https://example.com/a-b?x=1 für den vollständigen Bericht.",
    "Müller reiste nach Zürich — ein naiver Cafébesitzer begrüßte ihn.",
    "Angela Merkel traf gestern Emmanuel Macron in Berlin.",
    "Die Entscheidung des Ausschusses war nicht endgültig, aber klar.",
    "Apple und Microsoft meldeten im letzten Jahr Rekordgewinne.",
    "Eine [eingeklammerte] <Marke> | Pfeife und O'Briens Rock-'n'-Roll.",
    "Wir gingen 12 km am Fluss entlang, bevor es zu regnen begann.",
    "Das Europäische Parlament nahm die Entschließung mit 420 zu 95 Stimmen an.",
    "Ihr Schwager arbeitet bei den Vereinten Nationen in New York.",
]


def parallel_lines(n, offset=0):
    """``n`` varied (English, German) pairs: the templates above with numbered variants."""
    pairs = []
    for i in range(n):
        k = (i + offset) % len(ENGLISH)
        suffix = f" ({i + offset})" if i >= len(ENGLISH) else ""
        pairs.append((ENGLISH[k] + suffix, GERMAN[k] + suffix))
    return pairs


def write_parallel(prefix, pairs, src="en", tgt="de"):
    for index, lang in enumerate((src, tgt)):
        with open(f"{prefix}.{lang}", "w", encoding="utf-8") as handle:
            handle.writelines(pair[index] + "\n" for pair in pairs)


def pipeline_command(name, *args):
    """The command line of the pipeline's command ``name`` (e.g. tpp-prepare-corpus)."""
    return [sys.executable, "-m", PIPELINE_COMMANDS[name], *map(str, args)]


def run_script(name, *args, check=True, timeout=600):
    """Run the pipeline's command ``name``; returns the CompletedProcess."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    result = subprocess.run(pipeline_command(name, *args),
                            capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def count_lines(path):
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)
