#!/usr/bin/env bash
# What a GPU machine without internet needs for benchmarks/gpu_suite.sh and the quality
# study's short GPU call, made on a connected machine in one command: a tagged data
# folder, compressed, and the wheels its Python lacks.
#
# Usage:
#   benchmarks/gpu_prepare.sh [--force] [--train-pairs N] [--python-version X.Y] CORPUS
#
#   CORPUS  PREFIX of a parallel English-German corpus PREFIX.{en,de}[.xz]
#   --train-pairs  training pairs kept (default: all); valid and test sets are carved
#           out of the whole corpus first
#   --python-version  the GPU machine's Python (default 3.12)
#
# Writes data-bin/gpu_ende (8k joint BPE, POS/NER tags; raw/ holds the untokenised
# valid and test sets the study scores against), data-bin/gpu_ende.tar.xz (the same,
# compressed: what travels) and wheelhouse/ (fairseq's sources and the wheels the
# machine's Python lacks: numpy, scipy and scikit-learn are left out, which such images
# hold), all ignored by git, and prints what the archive and the wheels weigh together
# with the checkout. wheelhouse/tpp-commit.txt names the checkout's commit ("+": with
# changes not committed), which the GPU scripts record. Intermediate files go to work/gpu/.
# It says whether the data folder is the one the study's records (records/gpu) were
# trained on: on another, a study call trains runs that never join them. Python: PYTHON,
# else the project's .venv, else python on PATH.
set -euo pipefail

FORCE=()
PAIRS=all
PYVER=3.12
while [[ $# -gt 0 ]]; do
    case $1 in
        --force) FORCE=(--force); shift ;;
        --train-pairs) PAIRS=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) break ;;
    esac
done
if [[ $# -ne 1 || ! $PAIRS =~ ^([1-9][0-9]*|all)$ ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
CORPUS=$(realpath -m "$1")
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[[ -n ${PYTHON:-} || ! -x .venv/bin/python ]] || PY=.venv/bin/python
BIN=$(dirname "$(command -v "$PY")")

if [[ ! -e data-bin/gpu_ende/dict.en.txt || ${#FORCE[@]} -gt 0 ]]; then
    "$BIN/tpp-carve-splits" --corpus "$CORPUS" -s en -t de --out work/gpu/raw "${FORCE[@]}"
    mkdir -p work/gpu/sub
    for l in en de; do
        if [[ $PAIRS == all ]]; then
            cp "work/gpu/raw/train.$l" "work/gpu/sub/train.$l.tmp"
        else
            head -n "$PAIRS" "work/gpu/raw/train.$l" >"work/gpu/sub/train.$l.tmp"
        fi
        mv "work/gpu/sub/train.$l.tmp" "work/gpu/sub/train.$l"
        cp "work/gpu/raw/valid.$l" "work/gpu/raw/test.$l" work/gpu/sub/
    done
    "$BIN/tpp-prepare-corpus" -s en -t de --trainpref work/gpu/sub/train --validpref work/gpu/sub/valid \
        --testpref work/gpu/sub/test --name gpu_ende --work-dir work/gpu/prep --data-bin data-bin \
        --bpe-merges 8000 --workers 2 --quiet "${FORCE[@]}"
    mkdir -p data-bin/gpu_ende/raw
    cp work/gpu/sub/{valid,test}.{en,de} data-bin/gpu_ende/raw/
    rm -f data-bin/gpu_ende.tar.xz
fi
if [[ ! -e data-bin/gpu_ende.tar.xz ]]; then
    tar -cJf data-bin/gpu_ende.tar.xz.tmp -C data-bin gpu_ende && mv data-bin/gpu_ende.tar.xz.tmp data-bin/gpu_ende.tar.xz
fi

rm -rf work/gpu/wheels
bash scripts/setup_env.sh --download-wheelhouse work/gpu/wheels --python-version "$PYVER" --torch none --profile train
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 -d work/gpu/wheels pytest  # the tests stage runs pytest
rm -f work/gpu/wheels/{numpy,scipy,scikit_learn}-*
# the checkout's commit, for the node's copy, which has no history (the records name it)
commit=$(git rev-parse HEAD)
[[ -z $(git status --porcelain --untracked-files=no) ]] || commit+=+
echo "$commit" >work/gpu/wheels/tpp-commit.txt
rm -rf wheelhouse.tmp && cp -r work/gpu/wheels wheelhouse.tmp && rm -rf wheelhouse && mv wheelhouse.tmp wheelhouse

"$PY" - <<'EOF' || echo "gpu_prepare.sh: warning: data-bin/gpu_ende not compared with records/gpu" >&2
import sys
from pathlib import Path
from tpp_tools.study.config import StudyError
from tpp_tools.study.data import fingerprint
from tpp_tools.study.records import read_record
here = fingerprint(Path("data-bin/gpu_ende"))
theirs = set()
for path in sorted(Path("records/gpu").glob("*/record.json.gz")):
    try:
        theirs.add(read_record(path)["spec"]["data"])
    except StudyError as err:
        print(f"gpu_prepare.sh: warning: {err}", file=sys.stderr)
if theirs and theirs != {here}:
    print(
        f"gpu_prepare.sh: warning: data-bin/gpu_ende (fingerprint {here}) is not the data "
        f"the records in records/gpu were trained on ({', '.join(sorted(theirs))}): "
        "runs a study call trains on it will not join them",
        file=sys.stderr,
    )
elif theirs:
    print(f"gpu_prepare.sh: data-bin/gpu_ende is the data of the records in records/gpu ({here})")
EOF
total=$(( $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) + $(du -sb data-bin/gpu_ende.tar.xz wheelhouse | awk '{ s += $1 } END { print s }') ))
echo "gpu_prepare.sh: data-bin/gpu_ende.tar.xz and wheelhouse/ ready;" \
    "with the checkout $((total / 1048576)) MiB to copy to the node"
