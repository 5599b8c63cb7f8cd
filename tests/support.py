"""What the tests share: running the project's and fairseq's commands, tiny models, and
toy corpora.

Toy corpora come from one writer, :func:`write_corpus` (``{split: [(source, target)]}``
-> ``FOLDER/{split}.{src,tgt}``), and one binarizer, :func:`binarize` (fairseq-preprocess
with a joint dictionary, plus label streams in the data contract's layout). What differs
between tests is only the sentences, from one of three generators:

* :func:`lexicon_pairs` -- a made-up lexicon and reversed word order (``s3 s7`` ->
  ``t7 t3``), with labels derived from the words (:func:`toy_tags`): a tiny model learns
  it in a few hundred updates, and label alignment can be checked word by word;
* :func:`sentence_pairs` -- English words and a made-up target language with
  capitals, punctuation, quotes and hyphenated compounds, for Moses tokenisation,
  detokenisation, BPE removal and compound splitting (:func:`make_corpus` writes its
  raw, tokenised and BPE layers);
* :func:`english_pairs` -- real English (and German) sentences with names, numbers,
  URLs and escapes, for the spaCy tagging of the data pipeline.
"""

import argparse
import configparser
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

from tpp_pipeline.contract import label_dictionary_path, label_stream_prefix

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "tpp_plugin"
SCRIPTS = REPO / "scripts"
SAMPLE = REPO / "data" / "sample"
VENV_BIN = Path(sys.executable).parent  # fairseq's command-line tools live beside python
SPLITS = ("train", "valid", "test")

# ----------------------------------------------------------------------------- commands


def console_script_names():
    """The console scripts that setup.cfg declares (``tpp-...``)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    entries = config.get("options.entry_points", "console_scripts", fallback="")
    return [line.split("=")[0].strip() for line in entries.splitlines() if line.strip()]


def tool_env() -> dict:
    """Environment for command-line tools: this interpreter's folder first on PATH (fairseq's
    commands; the project's console scripts are on PATH too, see conftest.py), one thread
    (the tests run on small CPUs next to each other), no Python warnings in the output."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run(args, cwd=None, input_text=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    """Run a command; with ``check``, raise with its output when it fails."""
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=tool_env(),
        input=input_text,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_main_here(main, command) -> subprocess.CompletedProcess:
    """``command`` (a console script's name and arguments) run by ``main``, its entry
    point, in this process, with :func:`tool_env`'s environment: its exit status and
    output as a finished command's (argparse's usage errors and a traceback included);
    this process's signal handlers and environment as they were. For calls that only
    plan, report or refuse: those that train, or are stopped by signals, run as commands."""
    import contextlib
    import io
    import signal
    import traceback

    stdout, stderr = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    environment = dict(os.environ)
    os.environ.update(tool_env())
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main([str(c) for c in command[1:]])
            except SystemExit as exit:  # (argparse's usage errors)
                status = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
            except Exception:  # (as Python ends a command: its traceback, status 1)
                traceback.print_exc()
                status = 1
    finally:
        os.environ.clear()
        os.environ.update(environment)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return subprocess.CompletedProcess(command, status, stdout.getvalue(), stderr.getvalue())


def pipeline_command(name, *args):
    """The command line of the data pipeline's console script ``name`` (e.g.
    tpp-prepare-corpus), as a user types it."""
    return [name, *map(str, args)]


def run_pipeline(name, *args, check=True, timeout=600, cwd=None):
    """Run the data pipeline's console script ``name``; returns the CompletedProcess."""
    result = subprocess.run(
        pipeline_command(name, *args),
        capture_output=True,
        text=True,
        env=tool_env(),
        timeout=timeout,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{name} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def train_command(data, save_dir, max_update, save_interval_updates, extra=()):
    """scripts/train.sh on the CPU with fairseq's tiny plain Transformer on plain
    translation data."""
    return [
        "bash",
        str(SCRIPTS / "train.sh"),
        "--cpu",
        "--preset",
        "tiny",
        "--data",
        str(data),
        "--save-dir",
        str(save_dir),
        "--arch",
        "transformer_tiny",
        "--task",
        "translation",
        "--criterion",
        "label_smoothed_cross_entropy",
        "--lr",
        "5e-3",
        "--warmup-updates",
        "20",
        "--max-tokens",
        "400",
        "--update-freq",
        "1",
        "--max-update",
        str(max_update),
        "--save-interval-updates",
        str(save_interval_updates),
        "--keep-interval-updates",
        "10",
        "--log-interval",
        "5",
        "--",
        "--num-workers",
        "0",
        "--disable-validation",
        "--save-interval",
        "1000",
        *extra,
    ]


# ----------------------------------------------------------------------------- models


def make_dictionary(num_words: int = 20):
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(num_words):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    return d


class FakeTask:
    """The two or three things ``build_model`` asks of a task."""

    def __init__(self, dictionary, tag_dictionaries: Optional[Dict[str, object]] = None):
        self.source_dictionary = dictionary
        self.target_dictionary = dictionary
        self.tag_dictionaries = tag_dictionaries or {}


def build_model(
    arch: str = "transformer_pp_tiny", dictionary=None, tag_dictionaries=None, **overrides
):
    """A ``transformer_pp`` model of preset ``arch`` (options overridden by ``overrides``)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    import tpp_plugin  # noqa: F401  (registers the model)
    from tpp_plugin.models.transformer_pp import TransformerPPModel

    args = argparse.Namespace(**overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    task = FakeTask(dictionary or make_dictionary(), tag_dictionaries)
    return TransformerPPModel.build_model(args, task)


def attention_kernels():
    """A ``TorchDispatchMode`` (use it with ``with``) whose ``calls`` list, for every
    forward attention kernel that ``scaled_dot_product_attention`` dispatches to, its
    name and whether PyTorch's cuDNN attention backend was enabled at that moment. (A
    backward kernel is its forward's own; the unfused math path names no kernel.)"""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class AttentionKernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if "scaled_dot_product" in name and "backward" not in name:
                self.calls.append((name, torch.backends.cuda.cudnn_sdp_enabled()))
            return func(*args, **(kwargs or {}))

    return AttentionKernels()


def bf16_model_and_batch(device: str = "cuda"):
    """A 2+2-layer base-width ``transformer_pp`` in bfloat16 (training mode) on ``device``,
    its dictionary, 8 sources of 30 tokens and 8 target prefixes of 25."""
    d = make_dictionary(50)
    model = (
        build_model(
            "transformer_pp",
            dictionary=d,
            encoder_tag_layers="",
            encoder_layers=2,
            decoder_layers=2,
        )
        .to(device)
        .bfloat16()
        .train()
    )
    return d, model, random_tokens(d, 8, 30).to(device), random_tokens(d, 8, 25, seed=1).to(device)


def random_tokens(dictionary, bsz: int, length: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(dictionary.nspecial, len(dictionary), (bsz, length), generator=g)


# ----------------------------------------------------------------------------- corpora


def write_corpus(folder, pairs_by_split, src="src", tgt="tgt"):
    """Write ``{split: [(source, target)]}`` as ``folder/{split}.{src,tgt}`` (one sentence
    per line); returns ``{split: prefix}``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for split, pairs in pairs_by_split.items():
        for index, lang in enumerate((src, tgt)):
            with open(folder / f"{split}.{lang}", "w", encoding="utf-8") as handle:
                handle.writelines(pair[index] + "\n" for pair in pairs)
        prefixes[split] = folder / split
    return prefixes


def binarize(folder, dest, src="src", tgt="tgt", tags=None):
    """fairseq-preprocess ``folder/{train,valid,test}.{src,tgt}`` into ``dest`` with a joint
    dictionary. ``tags``, a function from a source line to ``{kind: [labels]}``, adds a
    label stream per kind in the data contract's layout (``dict.{kind}.txt``,
    ``{split}.{src}-{tgt}.{kind}.bin/.idx``), each binarized by fairseq-preprocess as a
    source-only language with a dictionary built from the labels."""
    folder, dest = Path(folder), Path(dest)
    splits = [s for s in SPLITS if Path(f"{folder / s}.{src}").exists()]
    prefixes = [arg for s in splits for arg in (f"--{s}pref", folder / s)]
    run(
        [
            "fairseq-preprocess",
            "--source-lang",
            src,
            "--target-lang",
            tgt,
            *prefixes,
            "--destdir",
            dest,
            "--joined-dictionary",
            "--workers",
            "1",
        ]
    )
    if tags is None:
        return dest
    labels = {
        s: [tags(line) for line in Path(f"{folder / s}.{src}").read_text().splitlines()]
        for s in splits
    }
    kinds = list(next(iter(labels["train"]), {}))
    for kind in kinds:
        for split in splits:
            Path(f"{folder / split}.{kind}").write_text(
                "".join(" ".join(line[kind]) + "\n" for line in labels[split])
            )
        binarized = folder / f"bin-{kind}"
        run(
            [
                "fairseq-preprocess",
                "--only-source",
                "--source-lang",
                kind,
                *prefixes,
                "--destdir",
                binarized,
                "--workers",
                "1",
            ]
        )
        (binarized / f"dict.{kind}.txt").rename(label_dictionary_path(str(dest), kind))
        for split in splits:
            for ext in ("bin", "idx"):
                (binarized / f"{split}.{kind}-None.{kind}.{ext}").rename(
                    f"{label_stream_prefix(str(dest), split, src, tgt, kind)}.{ext}"
                )
    return dest


def lexicon_pairs(sizes=(400, 40, 20), seed=1):
    """``{split: pairs}`` of the toy task a tiny model learns in a few hundred updates: the
    target is the source with every word mapped through a fixed lexicon and the order
    reversed."""
    rng = random.Random(seed)
    vocab = [f"s{i}" for i in range(24)]
    lexicon = {w: f"t{i}" for i, w in enumerate(vocab)}
    splits = {}
    for split, n in zip(SPLITS, sizes):
        splits[split] = []
        for _ in range(n):
            words = [rng.choice(vocab) for _ in range(rng.randint(3, 9))]
            splits[split].append((" ".join(words), " ".join(lexicon[w] for w in reversed(words))))
    return splits


def toy_tags(line: str):
    """Labels derived from the words of a :func:`lexicon_pairs` source line, so that tests
    can check alignment: a "POS" tag that depends on the word, and an IOB "NER" tag that
    marks runs of the words s0..s3. Returns ``(pos, ner)``."""
    words = line.split()
    pos = [f"P{int(w[1:]) % 5}" for w in words]
    ner, prev_entity = [], False
    for w in words:
        entity = int(w[1:]) < 4
        ner.append(("I-ENT" if prev_entity else "B-ENT") if entity else "O")
        prev_entity = entity
    return pos, ner


def binarize_tagged(work: Path, dest: Path, n_train: int = 400, seed: int = 1, tags=True) -> Path:
    """The :func:`lexicon_pairs` corpus (``work/{split}.{src,tgt}``) -> a data folder with
    a joint dictionary and (with ``tags``) the POS/NER label streams of
    ``translation_with_tags``."""
    write_corpus(work, lexicon_pairs((n_train, 40, 20), seed))
    return binarize(
        work, dest, tags=(lambda line: dict(zip(("pos", "ner"), toy_tags(line)))) if tags else None
    )


WORDS = [
    "the",
    "house",
    "cat",
    "dog",
    "is",
    "red",
    "big",
    "small",
    "runs",
    "sees",
    "a",
    "garden",
    "tree",
    "ice-cream",
    "state-of-the-art",
    "water",
    "drinks",
    "eats",
    "mountain",
    "fire",
    "there",
    "in",
    "on",
    "very",
    "cold",
    "warm",
    "book",
    "reads",
    "child",
    "woman",
    "man",
    "car",
    "blue",
    "green",
    "beautiful",
    "yesterday",
]


def target_word(word):
    """The made-up translation of ``word``: reversed, with a suffix; hyphens stay."""
    return "-".join(part[::-1] + "en" for part in word.split("-"))


def capitalise(text):
    """Upper-case the first letter (after an opening quote, if any)."""
    start = 1 if text.startswith('"') else 0
    return text[:start] + text[start].upper() + text[start + 1 :]


def sentence_pairs(sizes=(300, 40, 40), seed=7):
    """``{split: pairs}`` of English-like sentences and their word-for-word made-up
    translation (same order), with capitalised starts, commas, end punctuation, quotes
    and hyphenated compounds."""
    rng = random.Random(seed)
    splits = {}
    for split, size in zip(SPLITS, sizes):
        splits[split] = []
        for _ in range(size):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
            source, target = list(words), [target_word(w) for w in words]
            if rng.random() < 0.3:  # a comma after the second word
                source[1] += ","
                target[1] += ","
            end = rng.choice([".", ".", "?", "!"])
            src, tgt = " ".join(source) + end, " ".join(target) + end
            if rng.random() < 0.2:  # quoted sentence
                src, tgt = f'"{src}"', f'"{tgt}"'
            splits[split].append((capitalise(src), capitalise(tgt)))
    return splits


def fake_bpe(tokens):
    """Split long tokens in two with the '@@ ' continuation marker, as subword-nmt does."""
    return " ".join(
        token[:4] + "@@ " + token[4:] if len(token) > 7 else token for token in tokens.split()
    )


def make_corpus(root, sizes=(300, 40, 40), seed=7):
    """:func:`sentence_pairs` as an English-German corpus in three layers,
    ``root/{raw,tok,bpe}/{split}.{en,de}``: raw text, Moses tokens, fake BPE."""
    from sacremoses import MosesTokenizer

    root = Path(root)
    raw = sentence_pairs(sizes, seed)
    tokenizers = {lang: MosesTokenizer(lang=lang) for lang in ("en", "de")}

    def tokenize(pair):
        return tuple(
            tokenizers[lang].tokenize(line, return_str=True, escape=True)
            for lang, line in zip(("en", "de"), pair)
        )

    tok = {split: [tokenize(pair) for pair in pairs] for split, pairs in raw.items()}
    bpe = {
        split: [tuple(fake_bpe(line) for line in pair) for pair in pairs]
        for split, pairs in tok.items()
    }
    for layer, splits in (("raw", raw), ("tok", tok), ("bpe", bpe)):
        write_corpus(root / layer, splits, "en", "de")
    return root


ENGLISH = [
    "Barack Obama visited Paris on Monday.",
    'The well-known author didn\'t say "hello" & left early.',
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
    'Der bekannte Autor sagte nicht "hallo" & ging früh.',
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


def english_pairs(n, offset=0):
    """``n`` varied (English, German) pairs: the sentences above with numbered variants."""
    pairs = []
    for i in range(n):
        k = (i + offset) % len(ENGLISH)
        suffix = f" ({i + offset})" if i >= len(ENGLISH) else ""
        pairs.append((ENGLISH[k] + suffix, GERMAN[k] + suffix))
    return pairs


def head(src: Path, dst: Path, n: int) -> Path:
    """The first ``n`` lines of ``src`` into ``dst``."""
    with open(src, encoding="utf-8") as handle:
        dst.write_text("".join(line for _, line in zip(range(n), handle)), encoding="utf-8")
    return dst


def count_lines(path):
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)
