#!/usr/bin/env bash
# Translate a binarized split and score it: scripts/evaluate.py with the same options
# (see `scripts/evaluate.sh --help`); PYTHON picks the interpreter [python].
exec "${PYTHON:-python}" "$(dirname "${BASH_SOURCE[0]}")/evaluate.py" "$@"
