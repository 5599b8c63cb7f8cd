#!/usr/bin/env bash
# Submit the whole pipeline to SLURM as a chain of jobs, each starting only when the
# one before succeeded (--dependency=afterok), and print their job ids:
#
#   prepare -> tag (array, one task per shard) -> binarize -> train -> evaluate
#
# Usage (from anywhere; jobs run in the repository):
#   scripts/slurm/submit.sh [options]
#   scripts/slurm/submit.sh --preset en-de --partition gpu --nodes 2 --gpus-per-node 8
#   scripts/slurm/submit.sh --from train --preset en-fr           # data already binarized
#   scripts/slurm/submit.sh --cpu --tasks-per-node 2 --shards 2 ...  # a CPU-only cluster
#
# Options (variable in capitals, default in brackets; a flag beats the variable):
#   --preset NAME         PRESET [en-de]: en-de | en-fr | base | cpu | tiny (scripts/train.sh)
#   --prepare-cmd CMD     PREPARE_CMD [tpp-prepare-wmt14 --pair $PRESET]
#   --data-bin DIR        DATA_BIN [data-bin/wmt14_<pair>]
#   --save-dir DIR        SAVE_DIR [checkpoints/$PRESET]
#   --results-dir DIR     RESULTS_DIR [results/$PRESET]
#   --reference FILE      REFERENCE [work/wmt14_<pair>/raw/test.<tgt>]
#   --n-avg N             N_AVG [10]: checkpoints averaged before evaluation
#   --train-opts "..."    TRAIN_OPTS: extra scripts/train.sh options (e.g. "--max-update 1000")
#   --partition P         PARTITION [cluster default]
#   --account A           ACCOUNT [none]
#   --nodes N             NODES [1]: training nodes
#   --gpus-per-node N     GPUS_PER_NODE [4]
#   --tasks-per-node N    TASKS_PER_NODE [GPUS_PER_NODE; 1 with --cpu]
#   --cpus-per-task N     CPUS_PER_TASK [8]
#   --shards N            TAG_SHARDS [8]: tagging array size
#   --cpu                 CPU_ONLY=1: no GPUs requested; gloo, --cpu
#   --time-prepare T, --time-tag T, --time-binarize T, --time-train T, --time-evaluate T
#                         TIME_PREPARE [08:00:00] TIME_TAG [08:00:00] TIME_BINARIZE [08:00:00]
#                         TIME_TRAIN [48:00:00] TIME_EVALUATE [04:00:00]
#   --from STAGE, --to STAGE   submit only part of the chain (prepare tag binarize train evaluate)
#   --after JOBID[:JOBID...]  make the first submitted stage wait for these jobs (afterok)
#   --log-dir DIR         LOG_DIR [logs/slurm]: one log per job (array: per task)
#   --dry-run             print the sbatch commands instead of submitting
# Also passed to the jobs: TPP_VENV, DATA_NAME, SPLIT, PREPARE_STAGE_CMD, TAG_CMD,
# BINARIZE_CMD, FAIRSEQ_EXTRA, EVAL_OPTS, MASTER_PORT, SBATCH_EXTRA (extra sbatch
# options for every job). Option lists are split as a command line: quote a value with
# spaces ("--comment 'my run'"); nothing in them is expanded. See docs/slurm.md.
#
# Output: one line per job, "<stage> <job id>", e.g. "train 1234".
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$repo/scripts/slurm
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "submit.sh: error: $*" >&2; exit 2; }
source "$here/words.sh"

STAGES=(prepare tag binarize train evaluate)
from=prepare
to=evaluate
after=
dry_run=0
gpus_given=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --prepare-cmd|--train-opts)  # (their values are options)
      [[ $# -ge 2 ]] || die "$1 needs a value (see --help)" ;;
    --preset|--data-bin|--save-dir|--results-dir|--reference|--n-avg|--partition|\
    --account|--nodes|--gpus-per-node|--tasks-per-node|--cpus-per-task|--shards|\
    --time-prepare|--time-tag|--time-binarize|--time-train|--time-evaluate|--from|--to|\
    --after|--log-dir)  # "--partition --dry-run" is not the partition "--dry-run"
      [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value (see --help)" ;;
  esac
  case $1 in
    --preset) PRESET=$2; shift 2 ;;
    --prepare-cmd) PREPARE_CMD=$2; shift 2 ;;
    --data-bin) DATA_BIN=$2; shift 2 ;;
    --save-dir) SAVE_DIR=$2; shift 2 ;;
    --results-dir) RESULTS_DIR=$2; shift 2 ;;
    --reference) REFERENCE=$2; shift 2 ;;
    --n-avg) N_AVG=$2; shift 2 ;;
    --train-opts) TRAIN_OPTS=$2; shift 2 ;;
    --partition) PARTITION=$2; shift 2 ;;
    --account) ACCOUNT=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --gpus-per-node) GPUS_PER_NODE=$2; gpus_given=1; shift 2 ;;
    --tasks-per-node) TASKS_PER_NODE=$2; shift 2 ;;
    --cpus-per-task) CPUS_PER_TASK=$2; shift 2 ;;
    --shards) TAG_SHARDS=$2; shift 2 ;;
    --cpu) CPU_ONLY=1; shift ;;
    --time-prepare) TIME_PREPARE=$2; shift 2 ;;
    --time-tag) TIME_TAG=$2; shift 2 ;;
    --time-binarize) TIME_BINARIZE=$2; shift 2 ;;
    --time-train) TIME_TRAIN=$2; shift 2 ;;
    --time-evaluate) TIME_EVALUATE=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    --to) to=$2; shift 2 ;;
    --after) after=${2//,/:}; shift 2 ;;  # afterok:A:B (in afterok:A,B SLURM reads B as afterany)
    --log-dir) LOG_DIR=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

stage_index() {
  local i
  for i in "${!STAGES[@]}"; do [[ ${STAGES[$i]} == "$1" ]] && { echo "$i"; return; }; done
  die "unknown stage '$1' (one of: ${STAGES[*]})"
}
first=$(stage_index "$from")
last=$(stage_index "$to")
(( first <= last )) || die "--from $from comes after --to $to"
case ${PRESET:-en-de} in
  en-de|en-fr|base|cpu|tiny) ;;
  *) die "unknown preset '$PRESET' (one of: en-de en-fr base cpu tiny)" ;;
esac
# only the WMT'14 presets know their data and test reference: the others would fail at
# the first data stage, or at the end
if [[ ${PRESET:-en-de} != *-* && -z ${PREPARE_CMD:-} ]]; then
  declare -A OWN_CMD=([prepare]=PREPARE_STAGE_CMD [tag]=TAG_CMD [binarize]=BINARIZE_CMD)
  for stage in prepare tag binarize; do  # a data stage submitted without a command of its own
    i=$(stage_index "$stage")
    if (( first <= i && i <= last )) && [[ -z ${!OWN_CMD[$stage]:-} ]]; then
      die "--preset ${PRESET}: give the data pipeline's command (--prepare-cmd" \
          "\"tpp-prepare-corpus ...\"), which only the en-de and en-fr presets find by themselves"
    fi
  done
fi
if (( last >= $(stage_index evaluate) )) && [[ ${PRESET:-en-de} != *-* && -z ${REFERENCE:-} ]]; then
  die "--preset ${PRESET}: give the raw reference of the test split (--reference FILE)," \
      "which only the en-de and en-fr presets find by themselves"
fi

# Cluster resources
positive() {  # VARIABLE OPTION: a whole number of at least 1
  [[ ${!1} =~ ^[1-9][0-9]*$ ]] || die "$2 must be a positive number, not '${!1}'"
}
CPU_ONLY=${CPU_ONLY:-0}
[[ $CPU_ONLY == [01] ]] || die "CPU_ONLY must be 0 or 1 (--cpu sets 1), not '$CPU_ONLY'"
NODES=${NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
CPUS_PER_TASK=${CPUS_PER_TASK:-8}
TAG_SHARDS=${TAG_SHARDS:-8}
positive NODES --nodes
positive CPUS_PER_TASK --cpus-per-task
positive TAG_SHARDS --shards
N_AVG=${N_AVG:-10}
positive N_AVG --n-avg
if [[ $CPU_ONLY == 1 ]]; then
  (( ! gpus_given )) || die "--gpus-per-node $GPUS_PER_NODE with --cpu (CPU_ONLY=1), which asks" \
    "for no GPUs: leave one of them out"
  TASKS_PER_NODE=${TASKS_PER_NODE:-1}
  positive TASKS_PER_NODE --tasks-per-node
else
  positive GPUS_PER_NODE --gpus-per-node
  TASKS_PER_NODE=${TASKS_PER_NODE:-$GPUS_PER_NODE}
  positive TASKS_PER_NODE --tasks-per-node
  # each task trains on GPU number SLURM_LOCALID (fairseq's set_device): no more tasks than GPUs
  (( TASKS_PER_NODE <= GPUS_PER_NODE )) \
    || die "--tasks-per-node $TASKS_PER_NODE: each training task needs a GPU of its own," \
           "and --gpus-per-node is $GPUS_PER_NODE"
fi
TIME_PREPARE=${TIME_PREPARE:-08:00:00}
TIME_TAG=${TIME_TAG:-08:00:00}
TIME_BINARIZE=${TIME_BINARIZE:-08:00:00}
TIME_TRAIN=${TIME_TRAIN:-48:00:00}
TIME_EVALUATE=${TIME_EVALUATE:-04:00:00}
slurm_time() {  # VARIABLE OPTION: a time limit sbatch takes
  [[ ${!1} =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ || ${!1^^} =~ ^(UNLIMITED|INFINITE|-1)$ ]] \
    || die "$2 '${!1}' is not a SLURM time limit (MINUTES, HH:MM:SS or DAYS-HH:MM:SS)"
}
for stage in prepare tag binarize train evaluate; do
  slurm_time "TIME_${stage^^}" "--time-$stage"
done
slurm_seconds() {  # TIME: its seconds (a limit slurm_time took; 0 or -1: none)
  local t=$1 days=0 f
  [[ ${t^^} =~ ^(UNLIMITED|INFINITE|-1)$ ]] && { echo -1; return; }
  if [[ $t == *-* ]]; then  # DAYS-HH[:MM[:SS]]
    days=${t%%-*}; IFS=: read -ra f <<< "${t#*-}"
    echo $(( 10#$days * 86400 + 10#${f[0]} * 3600 + 10#${f[1]:-0} * 60 + 10#${f[2]:-0} ))
    return
  fi
  IFS=: read -ra f <<< "$t"  # MINUTES, MINUTES:SECONDS or HH:MM:SS
  case ${#f[@]} in
    1) echo $(( 10#${f[0]} * 60 )) ;;
    2) echo $(( 10#${f[0]} * 60 + 10#${f[1]} )) ;;
    *) echo $(( 10#${f[0]} * 3600 + 10#${f[1]} * 60 + 10#${f[2]} )) ;;
  esac
}
# train.sbatch is signalled 120 s before its limit to save and requeue itself
train_seconds=$(slurm_seconds "$TIME_TRAIN")
(( train_seconds <= 0 || train_seconds > 120 )) \
  || die "--time-train $TIME_TRAIN: the training job is told 2 minutes before its limit to" \
         "put itself back in the queue: give it more than that"
LOG_DIR=${LOG_DIR:-logs/slurm}
if [[ -n ${MASTER_PORT:-} ]]; then  # (fairseq would refuse it in the training job)
  [[ $MASTER_PORT =~ ^[0-9]{1,5}$ ]] && (( 10#$MASTER_PORT >= 1 && 10#$MASTER_PORT <= 65535 )) \
    || die "MASTER_PORT must be a TCP port (1-65535), not '$MASTER_PORT'"
fi

# Pipeline settings travel to the jobs through the environment (sbatch --export=ALL).
export TPP_ROOT=$repo
export PRESET=${PRESET:-en-de}
export DATA_NAME=${DATA_NAME:-wmt14_${PRESET/-/_}}
export DATA_BIN=${DATA_BIN:-data-bin/$DATA_NAME}
export SAVE_DIR=${SAVE_DIR:-checkpoints/$PRESET}
export RESULTS_DIR=${RESULTS_DIR:-results/$PRESET}
export N_AVG=${N_AVG:-10}
export PREPARE_CMD=${PREPARE_CMD:-tpp-prepare-wmt14 --pair $PRESET}
export CPU_ONLY TAG_SHARDS
for name in REFERENCE TRAIN_OPTS TPP_VENV SPLIT PREPARE_STAGE_CMD TAG_CMD BINARIZE_CMD \
            FAIRSEQ_EXTRA EVAL_OPTS MASTER_PORT; do
  [[ -n ${!name:-} ]] && export "${name?}"
done

cd "$repo"  # relative paths (logs, data) are relative to the repository
# What the first stage reads must be there now, unless it waits for a job that writes it.
if [[ -z $after ]]; then
  if (( first == $(stage_index train) )) && [[ ! -d $DATA_BIN ]]; then
    die "--from train: no data folder $DATA_BIN (give --data-bin, or submit from an earlier stage)"
  fi
  if (( first == $(stage_index evaluate) )) && [[ ! -d $SAVE_DIR ]]; then
    die "--from evaluate: no save dir $SAVE_DIR with checkpoints to average (give --save-dir)"
  fi
elif [[ $dry_run == 0 ]]; then
  for job in ${after//:/ }; do  # SLURM lets a dependency on a job it does not know start at once
    scontrol show job "$job" >/dev/null 2>&1 \
      || die "--after $after: SLURM knows no job $job (a job that ended long ago is forgotten: then leave --after out)"
  done
fi
[[ $dry_run == 1 ]] || mkdir -p "$LOG_DIR"
# a stage whose dependency failed is cancelled, not left pending for ever
common=(--parsable --export=ALL --kill-on-invalid-dep=yes)
[[ -n ${PARTITION:-} ]] && common+=(--partition "$PARTITION")
[[ -n ${ACCOUNT:-} ]] && common+=(--account "$ACCOUNT")
option_words sbatch_extra SBATCH_EXTRA
common+=("${sbatch_extra[@]}")
for name in TRAIN_OPTS FAIRSEQ_EXTRA EVAL_OPTS; do  # (split by the jobs: refused now)
  option_words checked "$name"
done

if [[ $CPU_ONLY == 1 ]]; then
  train_gpus=(--gpus-per-node=0)
  eval_gpus=(--gpus=0)
else
  train_gpus=(--gpus-per-node="$GPUS_PER_NODE")
  eval_gpus=(--gpus=1)
fi

declare -A resources=(
  [prepare]="--cpus-per-task=$CPUS_PER_TASK --time=$TIME_PREPARE"
  [tag]="--array=0-$((TAG_SHARDS - 1)) --cpus-per-task=$CPUS_PER_TASK --time=$TIME_TAG"
  [binarize]="--cpus-per-task=$CPUS_PER_TASK --time=$TIME_BINARIZE"
  [train]="--nodes=$NODES --ntasks-per-node=$TASKS_PER_NODE --cpus-per-task=$CPUS_PER_TASK --time=$TIME_TRAIN ${train_gpus[*]}"
  [evaluate]="--cpus-per-task=$CPUS_PER_TASK --time=$TIME_EVALUATE ${eval_gpus[*]}"
)

previous=$after
submitted=()  # "<stage> <id>" of the jobs submitted so far
for ((i = first; i <= last; i++)); do
  stage=${STAGES[$i]}
  log=$LOG_DIR/tpp-$stage-%j.out
  [[ $stage == tag ]] && log=$LOG_DIR/tpp-$stage-%A_%a.out
  # shellcheck disable=SC2206
  command=(sbatch "${common[@]}" --job-name="tpp-$stage" --output="$log" ${resources[$stage]})
  [[ -n $previous ]] && command+=(--dependency="afterok:$previous")
  command+=("$here/$stage.sbatch")
  if [[ $dry_run == 1 ]]; then
    printf '%q ' "${command[@]}"; echo
    previous="<$stage>"
    continue
  fi
  if ! id=$("${command[@]}"); then  # the chain is all or nothing: cancel what was submitted
    message="sbatch refused stage $stage (its message above)"
    if (( ${#submitted[@]} )); then
      scancel "${submitted[@]##* }" || true
      message+="; cancelled the stages submitted before it: $(IFS=,; echo "${submitted[*]}")"
    fi
    die "$message"
  fi
  id=${id%%;*}  # --parsable prints "id" or "id;cluster"
  echo "$stage $id"
  submitted+=("$stage $id")
  previous=$id
done
