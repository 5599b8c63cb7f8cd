# Sourced by every stage script of scripts/slurm/ (not run on its own).
#
# sbatch runs a copy of the job script from its spool folder, so a stage cannot find the
# repository from its own path: it uses TPP_ROOT (exported by submit.sh) or the folder
# sbatch was called from. It then puts the project's virtual environment first on PATH
# (TPP_VENV, default <repo>/.venv, skipped if absent: a module/conda environment loaded
# by the user works too) and moves to the repository, so relative paths in the settings
# mean the same on every node.

TPP_ROOT=${TPP_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
if [[ ! -f $TPP_ROOT/scripts/slurm/common.sh ]]; then
  echo "error: '$TPP_ROOT' is not the tpp repository: submit from its root or set TPP_ROOT" >&2
  exit 2
fi
export TPP_ROOT
source "$TPP_ROOT/scripts/slurm/words.sh"
if [[ -n ${TPP_VENV:-} && ! -x $TPP_VENV/bin/python ]]; then  # a mistyped one is not skipped
  echo "error: TPP_VENV='$TPP_VENV' is not an environment (no bin/python in it)" >&2
  exit 2
fi
TPP_VENV=${TPP_VENV:-$TPP_ROOT/.venv}
if [[ -x $TPP_VENV/bin/python ]]; then
  export PATH=$TPP_VENV/bin:$PATH
fi
cd "$TPP_ROOT"

# One place for the defaults that several stages share (submit.sh exports its own values).
PRESET=${PRESET:-en-de}
DATA_NAME=${DATA_NAME:-wmt14_${PRESET/-/_}}
DATA_BIN=${DATA_BIN:-data-bin/$DATA_NAME}
SAVE_DIR=${SAVE_DIR:-checkpoints/$PRESET}
RESULTS_DIR=${RESULTS_DIR:-results/$PRESET}
N_AVG=${N_AVG:-10}
CPU_ONLY=${CPU_ONLY:-0}
# the data pipeline command; stages add --stop-after / --tag-shard to it
PREPARE_CMD=${PREPARE_CMD:-tpp-prepare-wmt14 --pair $PRESET}

stage_banner() {
  echo "[$(date '+%F %T')] $1: job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID} on $(hostname -s), repo $TPP_ROOT"
}

run_logged() {  # print a command, then run it through bash (settings hold whole command lines)
  echo "+ $*"
  bash -c "$*"
}
