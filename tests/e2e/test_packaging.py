"""What the package declares: its requirements, its extras, and fairseq-fixed's wheel
without the torchaudio requirement (scripts/build_fairseq_wheel.py), so that `pip check`
is clean in the project's environment."""

import base64
import configparser
import csv
import hashlib
import importlib.util
import io
import re
import subprocess
import sys
import tarfile
import zipfile

from support import REPO


def load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_fairseq_wheel", REPO / "scripts" / "build_fairseq_wheel.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def requirement_names(lines):
    names = []
    for line in lines:
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.append(re.split(r"[\s;<>=!~\[]", line)[0].lower().replace("_", "-"))
    return names


def declared():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    install = config.get("options", "install_requires").strip().splitlines()
    extras = {
        name: value.strip().splitlines()
        for name, value in config.items("options.extras_require")
        if name not in config.defaults()
    }
    return install, extras


def test_the_all_extra_is_every_other_extra():
    _, extras = declared()
    assert set(extras) == {"tagging", "plots", "slurm", "all"}
    others = [line for name, lines in extras.items() if name != "all" for line in lines]
    assert sorted(extras["all"]) == sorted(others)


def test_the_environment_installs_what_the_package_declares():
    """make env installs requirements.txt (with requirements-train.txt), torch and
    fairseq: each of the package's requirements and extras is there, with the same
    specifier."""
    install, extras = declared()
    names = requirement_names(install)
    assert names[:2] == ["torch", "fairseq-fixed"], "the two that setup_env.sh installs first"
    listed = {}
    for path in ("requirements.txt", "requirements-train.txt"):
        for line in (REPO / path).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                listed[requirement_names([line])[0]] = line
    for line in install[2:] + [line for lines in extras.values() for line in lines]:
        name = requirement_names([line])[0]
        assert name in listed, f"{line} (setup.cfg) is not in requirements.txt"
        assert listed[name].replace(" ", "") == line.replace(" ", ""), (listed[name], line)


def test_pip_check_is_clean_in_the_project_environment():
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No broken requirements found" in proc.stdout


def test_the_installed_fairseq_is_the_wheel_without_torchaudio():
    from importlib import metadata

    assert metadata.version("fairseq-fixed") == "0.12.3.1+notorchaudio"
    requires = metadata.requires("fairseq-fixed")
    assert requires and not [r for r in requires if r.startswith("torchaudio")]
    assert [r for r in requires if r.startswith("hydra-core")], "the other requirements stay"


def make_wheel(path, requires):
    info = "demo_pkg-1.0.dist-info/"
    files = {
        "demo_pkg/__init__.py": b"x = 1\n",
        info + "METADATA": (
            "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires)
            + "\nA description:\nRequires-Dist: torchaudio stays in it.\n"
        ).encode(),
        info + "WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = [
        [
            name,
            "sha256="
            + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode(),
            str(len(data)),
        ]
        for name, data in files.items()
    ] + [[info + "RECORD", "", ""]]
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    files[info + "RECORD"] = record.getvalue().encode()
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def test_the_wheel_loses_torchaudio_and_says_so_in_its_version(tmp_path):
    builder = load_builder()
    wheel = make_wheel(
        tmp_path / "demo_pkg-1.0-py3-none-any.whl",
        ["numpy>=1.21", "torchaudio>=0.8.0", "torchaudio; extra == 'audio'", "torch>=1.13"],
    )
    out = tmp_path / "out"
    out.mkdir()
    new = builder.without_dropped_requirements(wheel, out)
    assert new.name == "demo_pkg-1.0+notorchaudio-py3-none-any.whl"
    info = "demo_pkg-1.0+notorchaudio.dist-info/"
    with zipfile.ZipFile(new) as z:
        names = set(z.namelist())
        assert names == {"demo_pkg/__init__.py", info + "METADATA", info + "WHEEL", info + "RECORD"}
        metadata = z.read(info + "METADATA").decode()
        assert "Version: 1.0+notorchaudio\n" in metadata
        assert (
            "Requires-Dist: numpy>=1.21\n" in metadata
            and "Requires-Dist: torch>=1.13\n" in metadata
        )
        assert "Requires-Dist: torchaudio" not in metadata.split("\n\n")[0]
        assert "\nRequires-Dist: torchaudio stays in it.\n" in metadata, "only the headers"
        record = list(csv.reader(io.StringIO(z.read(info + "RECORD").decode())))
        assert sorted(row[0] for row in record) == sorted(names)
        for name, digest, size in record:
            if digest:  # every hash and size in RECORD matches the file (pip checks them)
                data = z.read(name)
                assert (
                    digest
                    == "sha256="
                    + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                ), name
                assert int(size) == len(data)
    again = tmp_path / "again"
    again.mkdir()
    assert builder.without_dropped_requirements(new, again).name == new.name, "done once"


def test_the_source_distribution_holds_every_file_of_the_checkout(tmp_path):
    """(it held the packages alone: not the tests, the docs, nor the script that the
    install guide builds fairseq with)"""
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True, check=True
    ).stdout.split("\0")
    tracked = sorted(name for name in tracked if name and (REPO / name).is_file())
    copy = tmp_path / "checkout"
    for name in tracked:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((REPO / name).read_bytes())
    subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta as b; b.build_sdist('dist')"],
        cwd=copy, capture_output=True, check=True, timeout=300,
    )  # fmt: skip
    (sdist,) = (copy / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    made = {"PKG-INFO", "setup.cfg"} | {n for n in names if ".egg-info/" in n}
    assert sorted(names - made) == sorted(n for n in tracked if n != "setup.cfg")
