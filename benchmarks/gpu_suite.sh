#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/gpu.md in one command, each stage with its own
# log, in the order of what they decide (a GPU's time is usually short).
#
# Usage:
#   benchmarks/gpu_suite.sh [--force] [--budget SECONDS] DATA OUT [STAGE ...]
#
#   --budget  the seconds the whole suite may take (a lent GPU's time is counted): each
#          command runs under `timeout` with what is left, one cut off at the end keeps
#          its output in FILE.partial, and the commands left are recorded as not run
#   DATA   a binarized translation data folder (fairseq-preprocess or tpp-prepare-corpus;
#          tags are not needed)
#   OUT    a folder for the logs and tables (created). A stage whose table is already
#          there is skipped unless --force; tables are written under a temporary name
#          and renamed when their command has finished
#   STAGE  any of the stages below (default: all of them, in this order)
#
#   tests    the CUDA tests and the Triton kernels' tests, compiled
#   counts   operators per beam-search step and per training batch (count_ops.py)
#   step     one decoding step of the self-attention, with its reordering, timed against
#            fairseq's MultiheadAttention at 5 and 640 rows, PyTorch and Triton (bench_decode_step.py)
#   speed    training, generation, memory and MFU at d = 1024, bf16: fairseq's transformer,
#            its twin (the harness's control), tpp-conv0, tpp, tpp-triton, tpp-cudnn
#   mixed    300 updates of fairseq-train, base size: float32, --bf16, --bf16 with cuDNN's
#            attention allowed, --fp16, --memory-efficient-fp16 ("done training in", losses)
#   memory   what a training forward keeps for the backward pass (kept_for_backward.py)
#   split    --bf16's master copy flat against one tensor per parameter
#   profile  where beam search's time goes (profile_model.py --generation, 30 and 100 tokens)
#
# OUT/environment.txt records, run by run, the GPU, its driver and the versions the
# figures come from.
# A command that fails is recorded in OUT/status.txt (its output stays in FILE.partial)
# and the next one runs; the suite then exits with status 1. PYTHON names the Python
# interpreter to use (default: python on PATH); fairseq-train runs as its module.
set -uo pipefail

FORCE=0
BUDGET=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --force) FORCE=1; shift ;;
        --budget)
            if [[ ! ${2:-} =~ ^[1-9][0-9]*$ ]]; then
                echo "gpu_suite.sh: --budget takes a whole number of seconds, not '${2:-}'" >&2
                exit 2
            fi
            BUDGET=$2
            shift 2 ;;
        *) break ;;
    esac
done
if [[ $# -lt 2 ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
DATA=$1
OUT=$2
shift 2
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(tests counts step speed mixed memory split profile)
for stage in "${STAGES[@]}"; do
    case $stage in
        tests|counts|step|speed|mixed|memory|split|profile) ;;
        *) echo "gpu_suite.sh: unknown stage '$stage' (tests counts step speed mixed memory split profile)" >&2; exit 2 ;;
    esac
done
if [[ ! -d $DATA ]]; then
    echo "gpu_suite.sh: DATA '$DATA' is not a folder" >&2
    exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
mkdir -p "$OUT" || exit 2
# absolute before moving to the project's root: both may be given from anywhere
DATA=$(cd "$DATA" && pwd) && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$REPO" || exit 2
FAILED=0
# What the figures were measured on, for their report: the GPU, the driver, the versions
{  # appended: a later run that skips existing tables must not rewrite where they came from
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'): gpu_suite.sh ${STAGES[*]}"
    git describe --always --dirty 2>/dev/null || echo "(not a git checkout)"
    "$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}"); print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1 \
        || echo "(no nvidia-smi)"
} >>"$OUT/environment.txt"

run() {  # run STAGE FILE COMMAND...: stdout to OUT/FILE, stderr to OUT/FILE.log
    local stage=$1 file=$2
    shift 2
    if [[ -e $OUT/$file && $FORCE -eq 0 ]]; then
        printf '%s\t%s\tskipped: it exists (--force replaces it)\n' "$stage" "$file" | tee -a "$OUT/status.txt"
        return
    fi
    local limit=()
    if [[ $BUDGET -gt 0 ]]; then
        local left=$((BUDGET - SECONDS))  # SECONDS: since the suite started
        if [[ $left -le 0 ]]; then
            FAILED=1
            printf '%s\t%s\tnot run: the budget of %ds is spent\n' "$stage" "$file" "$BUDGET" \
                | tee -a "$OUT/status.txt"
            return
        fi
        # timeout signals the command's whole process group, the processes it started too
        limit=(timeout --kill-after=10 "$left")
    fi
    if declare -F "$1" >/dev/null; then  # a function of this script (exported below)
        set -- bash -c '"$@"' _ "$@"
    fi
    local start=$SECONDS
    "${limit[@]}" "$@" >"$OUT/$file.partial" 2>"$OUT/$file.log"
    local rc=$?
    if [[ $rc -eq 0 ]]; then
        mv -f "$OUT/$file.partial" "$OUT/$file"
    else
        FAILED=1
    fi
    local note=""  # timeout's statuses: 124 when it stopped the command, 137 when it killed it
    if [[ ${#limit[@]} -gt 0 && ( $rc -eq 124 || $rc -eq 137 ) ]]; then
        note=" (stopped: the budget of ${BUDGET}s ran out)"
    fi
    printf '%s\t%s\texit %d\t%ds%s\n' "$stage" "$file" "$rc" $((SECONDS - start)) "$note" \
        | tee -a "$OUT/status.txt"
}

BENCH=("$PY" benchmarks/bench_model.py --data "$DATA" --device cuda --dtype bf16)

mixed() {  # fairseq-train (as PY's module), 300 updates of the base preset, in each precision
    local name=$1
    shift
    rm -f "$OUT/mixed_$name.json"  # fairseq appends to its log file
    "$PY" -m fairseq_cli.train "$DATA" --user-dir tpp_plugin --arch transformer_pp --encoder-tag-layers "" \
        --task translation --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
        --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)' --lr 7e-4 \
        --lr-scheduler inverse_sqrt --warmup-updates 100 --max-tokens 8192 --max-update 300 \
        --no-save --disable-validation --seed 1 --log-format json --log-interval 20 \
        --log-file "$OUT/mixed_$name.json" "$@"
}
export -f mixed  # run() starts it through bash, under timeout with --budget
export PY DATA OUT

for stage in "${STAGES[@]}"; do
    case $stage in
    tests)
        run tests tests.txt "$PY" -m pytest -q tests/plugin/test_cuda.py tests/plugin/test_conv_heads_triton.py ;;
    counts)
        run counts counts.md "$PY" benchmarks/count_ops.py --data "$DATA" --device cuda --dtype bf16 --size 1024 \
            --models transformer,tpp,tpp-triton ;;
    step)
        run step step.md "$PY" benchmarks/bench_decode_step.py --device cuda --dtype bf16 --dim 1024 --rows 5,640 \
            --models mha,mha-b,tpp,tpp-triton ;;
    speed)
        run speed speed.md "${BENCH[@]}" --sizes 1024 --rounds 8 --mfu --json "$OUT/speed.json" \
            --models transformer,transformer-b,tpp-conv0,tpp,tpp-triton,tpp-cudnn ;;
    mixed)
        run mixed mixed_fp32.txt mixed fp32
        run mixed mixed_bf16.txt mixed bf16 --bf16
        run mixed mixed_bf16_cudnn.txt mixed bf16_cudnn --bf16 --cudnn-attention true
        run mixed mixed_fp16.txt mixed fp16 --fp16
        run mixed mixed_mefp16.txt mixed mefp16 --memory-efficient-fp16 ;;
    memory)
        run memory memory.md "$PY" benchmarks/kept_for_backward.py --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --max-tokens 16384 ;;
    split)
        run split split.md "${BENCH[@]}" --sizes 1024 --rounds 8 --mfu --no-generation \
            --models transformer,transformer-split,transformer-b,tpp,tpp-split ;;
    profile)
        run profile profile_30.md "$PY" benchmarks/profile_model.py --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --generation
        run profile profile_100.md "$PY" benchmarks/profile_model.py --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --generation --gen-len 100 ;;
    esac
done
echo "gpu_suite.sh: logs and tables in $OUT (status.txt: one line per command)"
exit $FAILED
