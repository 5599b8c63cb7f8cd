"""Every command of the project that the README and docs tell you to run runs as written.

The commands are taken from the documents themselves (fenced and indented code blocks,
continuation lines joined): each one whose first word is a ``scripts/...`` path,
``python scripts/...`` or one of the project's console scripts (``tpp-...``) is run with
``--help`` in a fresh, non-interactive bash, as its command form is written
(``scripts/train.sh`` must therefore be executable; ``bash scripts/train.sh`` would hide
a missing executable bit), with the installed console scripts on ``PATH``.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_lines(text):
    """Lines of fenced shell blocks and of 4-space indented code blocks."""
    fence = None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.lstrip()[3:].strip()
            continue
        if fence is not None:
            if fence in ("bash", "sh", "shell", "console"):
                yield line
        elif line.startswith("    "):
            yield line


def logical_commands(text):
    """Shell commands of the code blocks: continuations joined, split at ; && | &."""
    pending = ""
    for line in code_lines(text):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full, pending = pending + line, ""
        try:
            lexer = shlex.shlex(full, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:  # prose that happens to be indented (unbalanced quotes)
            continue
        command = []
        for token in tokens + [";"]:
            if token and set(token) <= set(";&|"):
                if command:
                    yield command
                command = []
            else:
                command.append(token)


def documented_scripts():
    """{command form: [documents]}: ``scripts/x``, ``python scripts/x.py`` or ``tpp-x``."""
    found = {}
    for document in DOCUMENTS:
        for command in logical_commands(document.read_text(encoding="utf-8")):
            while command and "=" in command[0] and not command[0].startswith(("-", "scripts/")):
                command = command[1:]  # VAR=value prefixes
            if not command:
                continue
            if command[0].startswith("scripts/") or re.fullmatch(r"tpp(-[a-z0-9]+)+", command[0]):
                form = command[0]
            elif (
                command[0] in ("python", "python3")
                and len(command) > 1
                and command[1].startswith("scripts/")
            ):
                form = f"python {command[1]}"
            else:
                continue
            found.setdefault(form, []).append(document.name)
    return found


FORMS = documented_scripts()


def test_the_documents_show_script_commands():
    # the README's own: the pipeline's steps
    for form in (
        "scripts/train.sh",
        "tpp-evaluate",
        "scripts/slurm/submit.sh",
        "tpp-average-checkpoints",
        "tpp-prepare-corpus",
        "tpp-prepare-wmt14",
        "tpp-plot-training",
    ):
        assert form in FORMS, sorted(FORMS)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_documented_command_runs_as_written(form, console_scripts):
    path = [str(Path(sys.executable).parent), str(console_scripts), "/usr/local/bin:/usr/bin:/bin"]
    env = {
        "PATH": os.pathsep.join(dict.fromkeys(path)),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", f"{form} --help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"`{form} --help` (from {', '.join(sorted(set(FORMS[form])))}) "
        f"failed with {result.returncode}:\n{result.stderr[-2000:]}"
    )
    assert result.stdout.strip(), f"`{form} --help` printed no help"
