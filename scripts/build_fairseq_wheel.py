#!/usr/bin/env python3
"""Builds fairseq-fixed 0.12.3.1 as a wheel against the torch of the Python that runs it,
without its torchaudio requirement.

    python scripts/build_fairseq_wheel.py --out DIR [--extensions all|text] [-- PIP_OPTIONS]
    pip install DIR/fairseq_fixed-*.whl

fairseq-fixed is the only fairseq 0.12 that imports on Python 3.11 and later. It has C++
extensions compiled against torch's C++ API, so it is built with --no-build-isolation
against the torch already installed. It also requires torchaudio, which no text task
imports and which exists only for the torch release it was made with: installed through
pip's resolver it would replace the environment's torch, and left out, `pip check`
reports it missing. The wheel made here is fairseq-fixed's own build with that one
requirement removed; its local version label (``0.12.3.1+notorchaudio``) says so, and it
satisfies ``fairseq-fixed==0.12.3.1``.

``--extensions text`` compiles only the three extensions that translation uses (see
CPP_EXTENSION_STUB) and needs no torch to build. Options after ``--`` go to
``pip wheel`` (e.g. ``--no-index --find-links DIR``). Only the standard library is used.
"""

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FAIRSEQ_SPEC = os.environ.get("TPP_FAIRSEQ_SPEC", "fairseq-fixed==0.12.3.1")
LOCAL_LABEL = "notorchaudio"
DROPPED = ("torchaudio",)

# A stand-in for torch.utils.cpp_extension: fairseq-fixed's setup.py imports it at the top,
# and pip runs setup.py to read the sdist's metadata even for `pip download --no-deps`.
# Reading metadata builds nothing, so a stand-in spares the download a real torch. The
# build's `--extensions text` uses it too: the extensions declared through it are the ones
# compiled against torch's C++ API (fairseq.libbase for BASE layers, fairseq.libnat for
# Levenshtein/insertion models, an example's alignment operator), which no text task of
# fairseq's or ours loads; its build_ext skips them, so the wheel holds the three that
# translation uses (libbleu, data_utils_fast, token_block_utils_fast) and does not depend
# on torch at all.
CPP_EXTENSION_STUB = """\
from setuptools import Extension
from setuptools.command.build_ext import build_ext


def CppExtension(name, sources, *args, **kwargs):
    ext = Extension(name, sources, *args, language="c++", **kwargs)
    ext.tpp_needs_torch = True
    return ext


CUDAExtension = CppExtension


class BuildExtension(build_ext):
    def build_extension(self, ext):
        if getattr(ext, "tpp_needs_torch", False):
            print(f"[setup] not building {ext.name} (compiled against torch; no text task loads it)")
            return
        super().build_extension(ext)
"""
# The extensions a choice must leave importable: "text" omits those the stub skips.
FAIRSEQ_EXTENSIONS = {
    "all": [
        "fairseq.libbleu",
        "fairseq.data.data_utils_fast",
        "fairseq.data.token_block_utils_fast",
        "fairseq.libbase",
        "fairseq.libnat",
    ],
    "text": [
        "fairseq.libbleu",
        "fairseq.data.data_utils_fast",
        "fairseq.data.token_block_utils_fast",
    ],
}


class BuildError(Exception):
    pass


def with_cpp_extension_stub(env, folder):
    """`env` with a package `torch.utils.cpp_extension` (the stand-in above), written under
    `folder`, first on PYTHONPATH."""
    stub = Path(folder) / "torch" / "utils"
    stub.mkdir(parents=True)
    for f in (stub.parent / "__init__.py", stub / "__init__.py"):
        f.write_text("")
    (stub / "cpp_extension.py").write_text(CPP_EXTENSION_STUB)
    paths = [str(folder)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return dict(env, PYTHONPATH=os.pathsep.join(paths))


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def without_dropped_requirements(wheel, out_dir):
    """Writes `wheel` into `out_dir` with the DROPPED requirements removed from its metadata
    and LOCAL_LABEL added to its version (dist-info folder, RECORD and file name follow).
    A wheel that already carries the label is copied as it is. Returns the new path."""
    wheel = Path(wheel)
    name, version, tags = re.fullmatch(r"([^-]+)-([^-]+)-(.+)\.whl", wheel.name).groups()
    if LOCAL_LABEL in version.split("+", 1)[-1].split("."):
        return Path(shutil.copy2(wheel, Path(out_dir) / wheel.name))
    new_version = f"{version}.{LOCAL_LABEL}" if "+" in version else f"{version}+{LOCAL_LABEL}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    target = Path(out_dir) / f"{name}-{new_version}-{tags}.whl"
    with zipfile.ZipFile(wheel) as src:
        files = {}
        for item in src.infolist():
            path = item.filename
            files[new_info + path[len(old_info) :] if path.startswith(old_info) else path] = (
                item,
                src.read(item),
            )
    metadata_path, record_path = new_info + "METADATA", new_info + "RECORD"
    lines = files[metadata_path][1].decode("utf-8").splitlines(keepends=True)
    kept, in_headers = [], True
    for line in lines:
        in_headers = in_headers and line.strip() != ""  # the description follows a blank line
        if in_headers and line.startswith("Version:"):
            line = f"Version: {new_version}\n"
        elif in_headers and line.startswith("Requires-Dist:"):
            requirement = re.split(r"[\s;<>=!~\[(]", line[len("Requires-Dist:") :].strip())[0]
            if requirement.lower() in DROPPED:
                continue
        kept.append(line)
    files[metadata_path] = (files[metadata_path][0], "".join(kept).encode("utf-8"))
    rows = []
    for row in csv.reader(io.StringIO(files[record_path][1].decode("utf-8"))):
        if not row:
            continue
        path = new_info + row[0][len(old_info) :] if row[0].startswith(old_info) else row[0]
        if path == metadata_path:
            data = files[metadata_path][1]
            row = [path, _record_hash(data), str(len(data))]
        else:
            row = [path, *row[1:]]
        rows.append(row)
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    files[record_path] = (files[record_path][0], record.getvalue().encode("utf-8"))
    partial = target.with_name(target.name + ".tmp")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as dst:
        for path, (item, data) in files.items():
            info = zipfile.ZipInfo(path, date_time=item.date_time)
            info.external_attr = item.external_attr
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data)
    os.replace(partial, target)
    return target


def build(out_dir, python=sys.executable, extensions="all", pip_options=(), env=None):
    """Builds FAIRSEQ_SPEC with `python`'s pip against its torch and writes the wheel,
    without the DROPPED requirements, into `out_dir`. Returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # fairseq's setup.py adds CUDA extensions whenever CUDA_HOME is set; the text tasks
    # use none of them, and building them would need nvcc and much longer.
    env = {k: v for k, v in (env or os.environ).items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    with tempfile.TemporaryDirectory(prefix="tpp-fairseq-") as tmp:
        tmp = Path(tmp)
        if extensions == "text":
            env = with_cpp_extension_stub(env, tmp / "stub")
        built = tmp / "wheel"
        cmd = [str(python), "-m", "pip", "wheel", "--quiet", "--no-build-isolation"]
        cmd += ["--no-deps", *map(str, pip_options), "-w", str(built), FAIRSEQ_SPEC]
        print("  $ " + shlex.join(cmd), flush=True)
        if subprocess.run(cmd, env=env, cwd=tmp).returncode != 0:
            raise BuildError(f"building {FAIRSEQ_SPEC} failed: {' '.join(cmd)}")
        wheels = sorted(built.glob("*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"pip wheel {FAIRSEQ_SPEC} left {len(wheels)} wheels, not one")
        return without_dropped_requirements(wheels[0], out_dir)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    pip_options = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        prog="scripts/build_fairseq_wheel.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the wheel")
    p.add_argument(
        "--extensions",
        choices=sorted(FAIRSEQ_EXTENSIONS),
        default="all",
        help="all: every extension (needs torch); text: the three translation uses",
    )
    args = p.parse_args(argv)
    try:
        wheel = build(args.out, extensions=args.extensions, pip_options=pip_options)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
