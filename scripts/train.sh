#!/usr/bin/env bash
# Train Transformer++ with fairseq-train using the project's recipe: runs tpp-train
# (tpp_tools/train.py, where the recipe is written once; `scripts/train.sh --help` lists
# every option).
#
# Usage:
#   scripts/train.sh [options] [-- extra fairseq-train options]
#
#   scripts/train.sh --preset en-de --data data-bin/wmt14_en_de --save-dir checkpoints/en-de
#   scripts/train.sh --preset en-fr --data data-bin/wmt14_en_fr -- --fp16 --num-workers 4
#   MAX_TOKENS=2048 UPDATE_FREQ=20 scripts/train.sh --preset en-de      # same, via variables
#
# Presets: en-de, en-fr (the paper's big models), base, cpu (the CPU demo's model), tiny.
# Every setting is a flag and a variable (a flag beats the variable); anything after `--`
# goes to fairseq-train as it is (fairseq keeps the last value of a repeated option).
#
# Resume: running the same command again continues the run from <save-dir>/checkpoint_last.pt
# (a torn one is first recovered by tpp-recover-checkpoint); a run that has reached
# --max-update is finished and trains nothing; one training per save dir (<save-dir>/.lock).
# --dry-run prints the fairseq-train command instead of running it.
set -euo pipefail
# The Python to run tpp-train with: PYTHON (else python3) where it imports fairseq and the
# project, else the project's environment (TPP_VENV, else the clone's .venv/: make env).
has_project() {
    "$1" -c 'import importlib.util as u, sys
sys.exit(not (u.find_spec("fairseq_cli") and u.find_spec("tpp_tools")))' 2>/dev/null
}
python="${PYTHON:-python3}"
if ! has_project "$python"; then
    venv="${TPP_VENV:-$(dirname "${BASH_SOURCE[0]}")/../.venv}"
    if ! has_project "$venv/bin/python"; then
        echo "train.sh: error: neither $python nor $venv/bin/python imports fairseq and" \
            "tpp_tools: activate the environment they are installed in (make env builds" \
            ".venv/), or set PYTHON or TPP_VENV" >&2
        exit 2
    fi
    python="$venv/bin/python"
fi
exec "$python" -m tpp_tools.train "$@"
