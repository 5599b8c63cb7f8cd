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
exec "${PYTHON:-python3}" -m tpp_tools.train "$@"
