# Sourced by submit.sh and common.sh (not run on its own).
#
# The settings that hold option lists (TRAIN_OPTS, FAIRSEQ_EXTRA, EVAL_OPTS, SBATCH_EXTRA)
# are split as a shell splits a command line: quotes keep a path with spaces whole
# (FAIRSEQ_EXTRA="--restore-file 'runs/my run/x.pt'"), and nothing is expanded (a * or a $
# stays as it is written).

option_words() {  # ARRAY VARIABLE: the words of $VARIABLE, into the array ARRAY
  local -n words_=$1
  local value=${!2:-}
  words_=()
  if ! printf '%s' "$value" | xargs -r true 2>/dev/null; then
    echo "${0##*/}: error: $2 cannot be split into options (a quote left open?): $value" >&2
    exit 2
  fi
  mapfile -d '' -t words_ < <(printf '%s' "$value" | xargs -r printf '%s\0')
}
