"""The shape of the project: its console scripts are installed and answer --help, and no
module finds another by editing sys.path."""

import os
import re
import subprocess

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
    "tpp-user-dir",
    "tpp-fairseq-rank",
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
    assert "DEBUG" not in shown.stderr, "importing fairseq turned on debug logging"


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


def test_the_code_is_formatted_and_clean():
    """One formatter for the project (ruff, configured in pyproject.toml): `make format`
    applies it; this fails on a file it would change, and on what ruff's default checks
    find (undefined and unused names, ambiguous ones, ...)."""
    shown = run(
        [VENV_BIN / "ruff", "format", "--check", "--diff", REPO], cwd=REPO, check=False, timeout=300
    )
    assert shown.returncode == 0, shown.stdout[-4000:] + shown.stderr[-2000:]
    checked = run([VENV_BIN / "ruff", "check", REPO], cwd=REPO, check=False, timeout=300)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-2000:]


# The shape of what a newcomer reads: README a map, docs/ guides, docstrings short.
README_LINES, DOC_LINES, MODULE_DOCSTRING_LINES = 160, 300, 30
COMMIT_HASH = re.compile(r"`[0-9a-f]{7,40}`|\bcommit [0-9a-f]{7,40}\b")


def module_docstring_lines(path):
    import ast

    with open(path, encoding="utf-8") as handle:
        docstring = ast.get_docstring(ast.parse(handle.read()), clean=False)
    return docstring.count("\n") + 1 if docstring else 0


def test_readme_and_docs_are_short_and_free_of_commit_hashes():
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(documents) > 5
    too_long, hashes = [], []
    for document in documents:
        lines = document.read_text(encoding="utf-8").splitlines()
        limit = README_LINES if document.name == "README.md" else DOC_LINES
        if len(lines) > limit:
            too_long.append(f"{document.relative_to(REPO)}: {len(lines)} lines (at most {limit})")
        hashes += [
            f"{document.relative_to(REPO)}:{number}: {line.strip()}"
            for number, line in enumerate(lines, start=1)
            if COMMIT_HASH.search(line)
        ]
    assert not too_long, "\n".join(too_long)
    assert not hashes, "commit hashes belong in the CHANGELOG and commit messages:\n" + "\n".join(
        hashes
    )


def test_module_docstrings_are_short():
    modules = [path for path in source_files() if path.endswith(".py")]
    assert any(path.endswith(os.path.join("modules", "hybrid_attention.py")) for path in modules)
    too_long = [
        f"{os.path.relpath(path, REPO)}: {lines} lines"
        for path in modules
        if (lines := module_docstring_lines(path)) > MODULE_DOCSTRING_LINES
    ]
    assert not too_long, f"module docstrings over {MODULE_DOCSTRING_LINES} lines:\n" + "\n".join(
        too_long
    )


def test_the_shape_checks_find_what_they_look_for():
    assert COMMIT_HASH.search("Re-run at `a668be9`, a later commit")
    assert COMMIT_HASH.search("the code of commit 803b71b, run version 2")
    assert not COMMIT_HASH.search(
        "a SHA-256 of each dictionary; run ids such as hybrid-s1-72759157"
    )


def test_the_package_version_is_the_changelogs_newest_release():
    """The version the package reports is the CHANGELOG's newest release (a section
    "## X.Y.Z — date"; "## Unreleased" may stand above it)."""
    import tpp_plugin

    releases = re.findall(
        r"^## (\d+\.\d+\.\d+) — \d{4}-\d{2}-\d{2}$",
        (REPO / "CHANGELOG.md").read_text(encoding="utf-8"),
        re.M,
    )
    assert releases and releases[0] == tpp_plugin.__version__, (
        releases[:1],
        tpp_plugin.__version__,
    )


@pytest.mark.parametrize("variable", ["TPP_VENV", "VENV"])
def test_make_puts_the_environment_where_the_variable_says(variable, tmp_path):
    """docs/install.md: ``TPP_VENV`` (or the Makefile's ``VENV``) puts the environment
    elsewhere, for ``make`` as for ``scripts/setup_env.sh``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPP_VENV", "VENV")}
    env[variable] = str(tmp_path / "elsewhere")
    planned = subprocess.run(
        ["make", "-n", "demo"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert f"{tmp_path / 'elsewhere'}/bin/tpp-demo" in planned.stdout


def test_make_runs_an_environment_in_a_folder_with_spaces(tmp_path):
    """Its recipes split ``$(VENV)/bin/...`` at the spaces (make: No such file)."""
    venv = tmp_path / "my env"
    (venv / "bin").mkdir(parents=True)
    for tool in ("tpp-demo", "python"):
        (venv / "bin" / tool).write_text(f'#!/bin/sh\necho {tool} ran "$@"\n')
        (venv / "bin" / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TPP_VENV", "VENV")}
    for target, said in (("demo", "tpp-demo ran"), ("bench", "python ran -m benchmarks")):
        ran = subprocess.run(  # (-o env: the environment is taken as built)
            ["make", "-o", "env", target, f"VENV={venv}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        assert ran.returncode == 0 and said in ran.stdout, ran.stdout + ran.stderr
