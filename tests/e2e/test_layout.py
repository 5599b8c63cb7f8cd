"""The shape of the project: its console scripts are installed and answer --help, and no
module finds another by editing sys.path."""

import os
import re

import pytest

from support import REPO, VENV_BIN, console_script_names, run

# the user-facing steps, one console script each (setup.cfg)
CONSOLE_SCRIPTS = [
    "tpp-prepare-corpus",
    "tpp-prepare-wmt14",
    "tpp-carve-splits",
    "tpp-average-checkpoints",
    "tpp-recover-checkpoint",
    "tpp-train",
    "tpp-evaluate",
    "tpp-plot-training",
    "tpp-plot-attention",
    "tpp-embedding-similarity",
    "tpp-tag-gradients",
    "tpp-study",
    "tpp-demo",
]


def test_setup_cfg_declares_the_console_scripts():
    assert console_script_names() == CONSOLE_SCRIPTS


@pytest.mark.parametrize("name", CONSOLE_SCRIPTS)
def test_console_script_from_the_installed_environment_prints_its_help(
    name, console_scripts, tmp_path, monkeypatch
):
    """Run as installed (the environment's own script, from another folder, without
    PYTHONPATH): the packages come from the install, not from the working directory."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    shown = run([console_scripts / name, "--help"], cwd=tmp_path, timeout=300)
    assert shown.stdout.startswith(f"usage: {name}"), shown.stdout[:300]


# a call of insert/append/extend/remove/pop/clear on sys.path, an assignment to it or to a
# slice of it, or site.addsitedir
SYS_PATH_EDIT = re.compile(
    r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\(|\[[^\]]*\]\s*=[^=]|\+?=[^=])"
    r"|site\.addsitedir\s*\("
)
SKIPPED_FOLDERS = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    "build",
    "dist",
    "runs",
    "work",
    "data-bin",
    "checkpoints",
    "results",
    "logs",
}


def source_files():
    """Every Python and shell file of the repository (also Python inside shell scripts)."""
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [
            s for s in subfolders if s not in SKIPPED_FOLDERS and not s.endswith(".egg-info")
        ]
        for name in files:
            if name.endswith((".py", ".sh", ".sbatch", ".cfg", ".toml")) or name == "Makefile":
                yield os.path.join(folder, name)


def test_no_module_modifies_sys_path():
    files = list(source_files())
    assert any(f.endswith(os.path.join("tpp_tools", "evaluate.py")) for f in files)
    offending = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if SYS_PATH_EDIT.search(line):
                    offending.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offending, "sys.path is modified (import installed packages instead):\n" + "\n".join(
        offending
    )


def test_the_check_finds_what_it_looks_for():
    path = "sys." + "path"  # spelt apart so that this file passes the check itself
    for line in (
        f"{path}.insert(0, 'x')",
        f"{path}.append(p)",
        f"{path}[:0] = [p]",
        f"{path} = [p] + {path}",
        f"{path} += [p]",
        "site." + "addsitedir(p)",
    ):
        assert SYS_PATH_EDIT.search(line), line
    for line in (f"if p in {path}:", f"print({path})", f"{path} == x"):
        assert not SYS_PATH_EDIT.search(line), line


def test_the_code_is_formatted():
    """One formatter for the project (ruff, configured in pyproject.toml): `make format`
    applies it; this fails on a file it would change."""
    shown = run(
        [VENV_BIN / "ruff", "format", "--check", "--diff", REPO], cwd=REPO, check=False, timeout=300
    )
    assert shown.returncode == 0, shown.stdout[-4000:] + shown.stderr[-2000:]
