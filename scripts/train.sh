#!/usr/bin/env bash
# Train Transformer++ with fairseq-train using the paper's recipe (Thapak & Hore 2020, IV).
#
# Usage:
#   scripts/train.sh [options] [-- extra fairseq-train options]
#
#   scripts/train.sh --preset en-de --data data-bin/wmt14_en_de --save-dir checkpoints/en_de
#   scripts/train.sh --preset en-fr --data data-bin/wmt14_en_fr -- --fp16 --num-workers 4
#   MAX_TOKENS=2048 UPDATE_FREQ=20 scripts/train.sh --preset en-de      # same, via variables
#
# Every setting is a variable (default in brackets) and a flag; a flag beats the variable,
# and anything after `--` is appended to the fairseq-train command line as is (fairseq
# keeps the last value of a repeated option, so `-- --lr 1e-3` overrides too).
#
#   --preset NAME              PRESET [en-de]   en-de | en-fr | base | cpu | tiny: picks ARCH, LR
#                              (cpu: the CPU demo's model; tiny: test-sized)
#   --data DIR                 DATA_BIN [data-bin/wmt14_en_de or wmt14_en_fr]
#   --save-dir DIR             SAVE_DIR [checkpoints/<preset>]
#   --arch NAME                ARCH [transformer_pp_wmt_en_de_big | ..._en_fr_big | transformer_pp |
#                              transformer_pp_cpu | transformer_pp_tiny]
#   --task NAME                TASK [translation_with_tags]
#   --criterion NAME           CRITERION [label_smoothed_cross_entropy_with_tags]
#   --user-dir DIR             USER_DIR [<repo>/tpp_plugin]
#   --lr LR                    LR [5e-4 big presets, 7e-4 base/tiny, 1e-3 cpu]: peak learning rate
#   --warmup-updates N         WARMUP_UPDATES [4000]
#   --label-smoothing EPS      LABEL_SMOOTHING [0.1]
#   --max-tokens N             MAX_TOKENS [4096]: tokens per GPU per forward/backward
#   --update-freq N            UPDATE_FREQ [10]: batches accumulated per update
#   --max-update N             MAX_UPDATE [320000]
#   --save-interval-updates N  SAVE_INTERVAL_UPDATES [1000]: write checkpoint_<epoch>_<update>.pt
#   --keep-interval-updates N  KEEP_INTERVAL_UPDATES [10]: how many of those to keep (>= the
#                              number you will average)
#   --seed N                   SEED [1]
#   --log-interval N           LOG_INTERVAL [100]
#   --log-file FILE            LOG_FILE [<save-dir>/train.log]: fairseq's log, appended to on
#                              every (re)start; tpp-plot-training plots it as it is
#   --cpu                      CPU [0]: train on the CPU (tests, laptops)
#   --fp16 | --no-fp16         FP16 [auto]: on when a GPU is visible, CPU=0 and no other
#                              precision (--bf16, --amp, ...) or --cpu comes after --
#   --no-recover               do not check checkpoint_last.pt before starting (see Resume)
#   --recover-only             only check (and if need be recover) checkpoint_last.pt, then exit
#   --dry-run                  print the command instead of running it
#
# The recipe: Adam (betas 0.9, 0.98, eps 1e-9) with the Transformer's learning-rate
# schedule, i.e. fairseq's inverse_sqrt (linear warm-up over 4000 updates to the peak
# LR, then decay with 1/sqrt(update)); the peak 5e-4 is d^-0.5 * warmup^-0.5 for d=1024
# (4.9e-4), as in "Attention is all you need". Label smoothing 0.1. Dropouts come from
# the --arch preset (see tpp_plugin/models/transformer_pp.py). 320K updates, each
# accumulating 10 batches (--update-freq 10). The paper gives no batch size; 4096
# tokens per GPU is fairseq's usual choice for big Transformers.
#
# Checkpoints: one every SAVE_INTERVAL_UPDATES updates, the last KEEP_INTERVAL_UPDATES
# of them kept (no per-epoch files), so tpp-average-checkpoints can average the
# last 10. Resume: fairseq restores <save-dir>/checkpoint_last.pt (model, optimizer,
# LR schedule, update count and position in the epoch) whenever it exists, so running
# the same command again continues the run where the last checkpoint left it. Before
# fairseq starts, tpp-recover-checkpoint checks that checkpoint_last.pt loads:
# fairseq copies it without a temporary name, so a kill during the copy leaves it
# truncated. A damaged one is moved aside (checkpoint_last.pt.damaged-<time>) and the
# newest readable checkpoint of the save dir takes its place; the script says which.
# (With -- --restore-file FILE, fairseq resumes from FILE and nothing is checked.)
#
# Log: the console shows fairseq's simple format; the same lines go to LOG_FILE.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "train.sh: error: $*" >&2; exit 2; }

PRESET=${PRESET:-en-de}
dry_run=0
recover=1
recover_only=0
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --preset) PRESET=$2; shift 2 ;;
    --data) DATA_BIN=$2; shift 2 ;;
    --save-dir) SAVE_DIR=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --task) TASK=$2; shift 2 ;;
    --criterion) CRITERION=$2; shift 2 ;;
    --user-dir) USER_DIR=$2; shift 2 ;;
    --lr) LR=$2; shift 2 ;;
    --warmup-updates) WARMUP_UPDATES=$2; shift 2 ;;
    --label-smoothing) LABEL_SMOOTHING=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --update-freq) UPDATE_FREQ=$2; shift 2 ;;
    --max-update) MAX_UPDATE=$2; shift 2 ;;
    --save-interval-updates) SAVE_INTERVAL_UPDATES=$2; shift 2 ;;
    --keep-interval-updates) KEEP_INTERVAL_UPDATES=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --log-interval) LOG_INTERVAL=$2; shift 2 ;;
    --log-file) LOG_FILE=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --fp16) FP16=1; shift ;;
    --no-fp16) FP16=0; shift ;;
    --no-recover) recover=0; shift ;;
    --recover-only) recover_only=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (fairseq-train options go after '--'; see --help)" ;;
  esac
done

# Per-preset defaults: the paper's two WMT'14 models, plus base, the CPU demo's model and
# a test-sized one for small runs.
case $PRESET in
  en-de) arch=transformer_pp_wmt_en_de_big; lr=5e-4; data=data-bin/wmt14_en_de ;;
  en-fr) arch=transformer_pp_wmt_en_fr_big; lr=5e-4; data=data-bin/wmt14_en_fr ;;
  base)  arch=transformer_pp;               lr=7e-4; data=data-bin/wmt14_en_de ;;
  cpu)   arch=transformer_pp_cpu;           lr=1e-3; data=data-bin/sample_en_de ;;
  tiny)  arch=transformer_pp_tiny;          lr=7e-4; data=data-bin/sample ;;
  *) die "unknown --preset '$PRESET' (en-de, en-fr, base, cpu or tiny)" ;;
esac
ARCH=${ARCH:-$arch}
LR=${LR:-$lr}
DATA_BIN=${DATA_BIN:-$repo/$data}
SAVE_DIR=${SAVE_DIR:-$repo/checkpoints/$PRESET}
TASK=${TASK:-translation_with_tags}
CRITERION=${CRITERION:-label_smoothed_cross_entropy_with_tags}
USER_DIR=${USER_DIR:-$repo/tpp_plugin}
WARMUP_UPDATES=${WARMUP_UPDATES:-4000}
LABEL_SMOOTHING=${LABEL_SMOOTHING:-0.1}
MAX_TOKENS=${MAX_TOKENS:-4096}
UPDATE_FREQ=${UPDATE_FREQ:-10}
MAX_UPDATE=${MAX_UPDATE:-320000}
SAVE_INTERVAL_UPDATES=${SAVE_INTERVAL_UPDATES:-1000}
KEEP_INTERVAL_UPDATES=${KEEP_INTERVAL_UPDATES:-10}
SEED=${SEED:-1}
LOG_INTERVAL=${LOG_INTERVAL:-100}
LOG_FILE=${LOG_FILE:-$SAVE_DIR/train.log}
CPU=${CPU:-0}
FP16=${FP16:-auto}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}

[[ $dry_run == 1 || -d $DATA_BIN ]] || die "data folder '$DATA_BIN' does not exist (set --data or DATA_BIN)"
[[ $dry_run == 1 || -d $USER_DIR ]] || die "plugin folder '$USER_DIR' does not exist (set --user-dir or USER_DIR)"

# a precision (or the CPU) asked for after -- is fairseq's to take: --fp16 is not added
# next to it (fairseq refuses --fp16 with --bf16, which it ties to --tpu, and with --amp)
asked=""
for opt in "${extra[@]}"; do
  case $opt in
    --fp16|--memory-efficient-fp16|--bf16|--memory-efficient-bf16|--amp|--cpu) asked=$opt; break ;;
  esac
done
gpu_visible() {  # nvidia-smi lists the node's GPUs whatever CUDA_VISIBLE_DEVICES hides
  [[ ${CUDA_VISIBLE_DEVICES-unset} != "" && ${CUDA_VISIBLE_DEVICES-unset} != -1 ]] \
    && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1
}

device=()
if [[ $CPU == 1 ]]; then
  device=(--cpu)
  [[ $FP16 == 1 ]] && die "--fp16 needs a GPU (drop --cpu or --fp16)"
elif [[ -n $asked ]]; then
  [[ $FP16 == 1 && $asked != --fp16 ]] && die "--fp16 and $asked (after --) ask for two precisions: keep one"
elif [[ $FP16 == 1 ]] || { [[ $FP16 == auto ]] && gpu_visible; }; then
  device=(--fp16)
fi

cmd=(
  "$FAIRSEQ_TRAIN" "$DATA_BIN"
  --user-dir "$USER_DIR"
  --task "$TASK" --arch "$ARCH"
  --criterion "$CRITERION" --label-smoothing "$LABEL_SMOOTHING"
  --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-9 --clip-norm 0.0 --weight-decay 0.0
  --lr-scheduler inverse_sqrt --lr "$LR" --warmup-updates "$WARMUP_UPDATES" --warmup-init-lr 1e-07
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE"
  --save-dir "$SAVE_DIR"
  --save-interval-updates "$SAVE_INTERVAL_UPDATES" --keep-interval-updates "$KEEP_INTERVAL_UPDATES"
  --no-epoch-checkpoints
  --seed "$SEED" --log-format simple --log-interval "$LOG_INTERVAL" --log-file "$LOG_FILE"
  "${device[@]}"
  "${extra[@]}"
)

if [[ $dry_run == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
mkdir -p "$SAVE_DIR" "$(dirname "$LOG_FILE")"
if [[ $recover == 1 ]]; then
  # the fairseq options as fairseq will see them (--save-dir, --restore-file and
  # --checkpoint-suffix may also come after --; the last value counts)
  tpp-recover-checkpoint "${cmd[@]:2}" || exit $?
fi
[[ $recover_only == 1 ]] && exit 0
if [[ -f $SAVE_DIR/checkpoint_last.pt ]]; then
  echo "train.sh: resuming from $SAVE_DIR/checkpoint_last.pt" >&2
fi
# exec: signals sent to this script (SLURM, Ctrl-C) reach fairseq-train directly
exec "${cmd[@]}"
