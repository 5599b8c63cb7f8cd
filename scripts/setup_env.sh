#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment: torch 2.13.0 (the CPU build where
# pip sees PyTorch's CPU index, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu),
# fairseq-fixed 0.12.3.1 built against it, the pipeline's tools and this package.
#
#   scripts/setup_env.sh            # venv in ./.venv (or $TPP_VENV)
#
# For a node without internet (scripts/wheelhouse.py; `--help` lists the options):
#   scripts/setup_env.sh --download-wheelhouse DIR [--python-version 3.12] [--torch none|cpu|VER]
#                        [--profile train|full] ...    # on a machine with internet
#   scripts/setup_env.sh --from-wheelhouse DIR [--venv PATH] [--system-site-packages]
#                        [--fairseq-extensions all|text]
#                                                        # on the node: pip --no-index
#
# Re-running is cheap: a stamp holding the hash of every install input is compared first.
# torch is pinned for *every* pip call, including packages' isolated build environments
# (PIP_CONSTRAINT), so no step can replace it with a CUDA build.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${TPP_VENV:-$root/.venv}
python=${PYTHON:-python3}
TORCH_VERSION=2.13.0
FAIRSEQ_SPEC="fairseq-fixed==0.12.3.1"

case "${1:-}" in
  "") ;;
  --download-wheelhouse|--from-wheelhouse|-h|--help)
    export TPP_TORCH_VERSION=$TORCH_VERSION TPP_FAIRSEQ_SPEC=$FAIRSEQ_SPEC
    exec "$python" "$root/scripts/wheelhouse.py" "$@" ;;
  *) echo "usage: $0 [--download-wheelhouse DIR ... | --from-wheelhouse DIR ...] (--help)" >&2; exit 2 ;;
esac

stamp_inputs() {
  cat "$root/constraints.txt" "$root/requirements.txt" "$root/requirements-train.txt" \
      "$root/setup.cfg" "$root/pyproject.toml" "$root/scripts/setup_env.sh" \
      "$root/scripts/build_fairseq_wheel.py"
}
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
stamp="$venv/.tpp-env-stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "import fairseq, tpp_plugin, tpp_fairseq, tpp_pipeline, tpp_tools" 2>/dev/null; then
  echo "[setup] environment $venv is up to date"
  exit 0
fi

echo "[setup] building environment in $venv"
# (again over a venv whose creation was interrupted before it had pip: venv completes it)
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$python" -m venv "$venv"
# (pip splits PIP_CONSTRAINT at spaces: as a file URL a folder with spaces stays whole)
PIP_CONSTRAINT=$("$python" -c 'import pathlib, sys; print(pathlib.Path(sys.argv[1]).as_uri())' \
  "$root/constraints.txt")
export PIP_CONSTRAINT
export PIP_DISABLE_PIP_VERSION_CHECK=1
# into the venv whatever the user's pip variables say (PIP_USER=1 fails inside a venv)
export PIP_USER=0
unset PIP_TARGET PIP_PREFIX PIP_ROOT
pip=("$venv/bin/python" -m pip install --quiet)

# 1. torch first, plus what fairseq's C extensions build with.
"${pip[@]}" "torch==$TORCH_VERSION" cython numpy setuptools wheel
# 2. fairseq against that torch, without its torchaudio requirement (cannot load on this
#    build, never imported by text tasks; scripts/build_fairseq_wheel.py). pip caches the
#    build, so a fresh venv reuses it.
if ! "$venv/bin/python" -c "
import importlib.metadata as m, fairseq
assert not any(r.startswith('torchaudio') for r in m.requires('fairseq-fixed') or [])
" 2>/dev/null; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  "$venv/bin/python" "$root/scripts/build_fairseq_wheel.py" --out "$wheels" >/dev/null
  "${pip[@]}" --no-deps --force-reinstall "$wheels"/fairseq_fixed-*.whl
fi
# 3. everything else, then this project (editable: --user-dir tpp_plugin and imports agree;
#    its packages tpp_plugin, tpp_pipeline, tpp_tools and the tpp-... console scripts).
"${pip[@]}" -r "$root/requirements.txt"
"${pip[@]}" --no-build-isolation --no-deps -e "$root"
# every installed package's requirements met (fairseq-fixed's included)
"$venv/bin/python" -m pip check >/dev/null || { "$venv/bin/python" -m pip check >&2; exit 1; }

"$venv/bin/python" - <<PY
import torch, fairseq, spacy, tpp_plugin, tpp_pipeline, tpp_tools
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
print(f"[setup] torch {torch.__version__}, fairseq {fairseq.__version__}, spacy {spacy.__version__}")
PY
echo "$want" > "$stamp"
