"""Shared fixtures of the test-suite.

The project's console scripts (``tpp-...``, setup.cfg) must be on ``PATH`` for the
commands the tests run, as they are for a user: ``scripts/train.sh`` runs
``tpp-recover-checkpoint``, the SLURM stages run ``tpp-average-checkpoints`` and
``tpp-evaluate``. Where the environment running the tests has them (``make test``
installs the project into it), they are used; otherwise the project is installed,
editable and without dependencies, into a throw-away virtual environment that sees
this environment's packages, and its scripts are put on ``PATH`` behind this
interpreter's own folder.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from support import REPO, console_script_names

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in one worker process per core (pytest-xdist): one
    # thread each, as the commands the tests start already have (support.tool_env).
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Without a GPU, LocalConv's Triton kernels run in Triton's interpreter
    # (tests/plugin/test_conv_heads_triton.py). Triton reads this when it is imported,
    # so it is set before any test module can import it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def install_into_throwaway_venv(folder):
    """Install this checkout (editable, no dependencies, no index) into a new venv at
    ``folder`` whose interpreter also sees this environment's packages; return its
    ``bin`` folder."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "_tpp_base_environment.pth").write_text("".join(f"{p}\n" for p in here))
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-e",
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        raise RuntimeError(f"installing {REPO} into {folder} failed:\n{pip.stdout}{pip.stderr}")
    return folder / "bin"


@pytest.fixture(scope="session", autouse=True)
def console_scripts(tmp_path_factory):
    """The folder holding the project's console scripts, on PATH for the whole session."""
    here = Path(sys.executable).parent
    names = console_script_names()
    if all((here / name).exists() for name in names):
        folder = here
    else:
        folder = install_into_throwaway_venv(tmp_path_factory.mktemp("installed") / "venv")
        missing = [name for name in names if not (folder / name).exists()]
        assert not missing, f"the install made no {missing}"
    os.environ["PATH"] = os.pathsep.join([str(here), str(folder), os.environ.get("PATH", "")])
    return folder


@pytest.fixture(scope="session")
def nmt_corpus(tmp_path_factory):
    """The tiny English-German corpus of :func:`support.make_corpus` (raw, tokenised and
    BPE layers) and its BPE layer binarized: ``{"corpus": root, "data": data-bin}``.
    Shared by the tests that train on it; nothing writes into it."""
    from support import binarize, make_corpus

    root = tmp_path_factory.mktemp("nmt_corpus")
    corpus = make_corpus(root / "corpus")
    return {"corpus": corpus, "data": binarize(corpus / "bpe", root / "data-bin", "en", "de")}


def pytest_collection_modifyitems(config, items):
    """`make test` hands whole modules to its workers (``--dist loadfile``), in this order:
    the modules with slow tests first, then the rest, each group by its number of tests.
    pytest-xdist's own order (by number of tests alone) would leave the longest modules,
    which have few tests, to the end, and one worker running them while the other idles."""
    modules = {}
    for item in items:
        module = modules.setdefault(item.nodeid.split("::")[0], [0, 0])
        module[0] += 1
        module[1] += item.get_closest_marker("slow") is not None
    key = {name: (not slow, -count) for name, (count, slow) in modules.items()}
    items.sort(key=lambda item: key[item.nodeid.split("::")[0]])
