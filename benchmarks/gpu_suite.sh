#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/gpu.md in one command (docs/gpu_commands.md), the
# stages in the order of what they decide, each under its own time limit inside one
# overall budget.
#
# Usage:
#   benchmarks/gpu_suite.sh [--force] [--budget SECONDS] [--limit STAGE=SECONDS ...]
#                           [--stand-in] [--pack DIR] DATA OUT [STAGE ...]
#
#   --budget  the seconds the whole suite may take (an allocation's time is counted): no
#          command runs past it; those left are recorded as not run
#   --limit   the seconds one stage may take (default: the figure beside it below, or
#          the whole budget for a stage asked for alone), within the budget: a command
#          cut off keeps its output in FILE.partial, and the stage's commands left are
#          recorded as not run; the next stage runs. Each stage's time is printed as it
#          starts
#   --stand-in  the decide stage's commands on the CPU, small (d = 128 and 256, 2+2 layers,
#          batches of 1,024 and 512 tokens, two rounds, the tests only collected; 1,800 s unless
#          --limit):
#          tries the stage's commands and tables on a machine without a GPU, where
#          tpp-fused runs the PyTorch operations; no figure of it is a GPU's
#   --pack DIR  after every stage, DIR receives summary.md, status.txt and
#          gpu_results.tar.gz (all of OUT): what returns from a machine that sends
#          back only a few files, even if the suite is stopped midway
#   DATA   a binarized data folder with POS/NER tags (tpp-prepare-corpus): the mixed
#          stage trains transformer_pp with its tag losses
#   OUT    a folder for the logs and tables (created). A command whose output is already
#          there is skipped unless --force (so a second call resumes where the first
#          stopped); outputs are written under a temporary name and renamed when their
#          command has finished
#   STAGE  any of the stages below (default: all of them, in this order)
#
#   tests        90 s  the CUDA tests and the Triton kernels' tests, compiled
#   decide      420 s  what decides the fused conv heads (docs/gpu_commands.md): their
#                      tests on CUDA; training, bf16, paired (bench_model.py): transformer,
#                      its twin (the control), tpp, tpp-fused at base size (d = 512, 6+6
#                      layers, 8,192 tokens) and at d = 1024 (16,384 x 2), with MFU; the
#                      master copy synced by multi-tensor copies (transformer-sync,
#                      tpp-fused-sync) at base; operators on CUDA; float32 at base. Each
#                      table is printed, and packed, as its command ends
#   compiled    400 s  compiled layers (TPP_FAIRSEQ_SPEEDUPS=compiled-layers), training,
#                      bf16, paired at base size: transformer, its twin, transformer-compiled,
#                      tpp-fused, tpp-compiled, tpp-fused-compiled (the fused kernels as
#                      operators of the graphs), with MFU and the seconds of the untimed
#                      first steps (the compiling)
#   mixed       300 s  fairseq-train, base size (6+6 layers, bench_model.py's dropouts for
#                      both), 150 updates: transformer and transformer_pp with the tag
#                      losses in float32, --bf16 and --fp16;
#                      --bf16 with the conv heads as PyTorch operations (transformer_pp,
#                      --conv-heads-impl taps); --memory-efficient-fp16 (transformer_pp)
#   speed       150 s  training at d = 1024, bf16: transformer, its twin (the control),
#                      tpp, tpp-taps (bench_model.py; its table grows round by round)
#   split        90 s  --bf16's master copy flat against one tensor per parameter
#   generation  180 s  beam 5 at d = 1024, bf16, 30- and 100-token outputs, same models
#   step         60 s  one decoding step of the self-attention (bench_decode_step.py)
#   cudnn       150 s  cuDNN's attention kept on: fairseq-train of transformer as in mixed,
#                      and training at d = 1024 with its plans built (bench_model.py
#                      --cudnn-attention)
#   profile     150 s  where training's and beam search's time goes (profile_model.py)
#   memory       60 s  what a training forward keeps for the backward (kept_for_backward.py)
#   counts       60 s  operators per beam-search step and per training batch (count_ops.py)
#
# Every stage appends its table to OUT/summary.md and prints it on standard output as
# it finishes. OUT/environment.txt records the GPU, its driver and the versions; every
# command's exit status and seconds go to OUT/status.txt. A command that fails is
# recorded and the next one runs; the suite then exits with status 1. PYTHON names the
# Python interpreter to use (default: python on PATH).
set -uo pipefail

ALL_STAGES=(tests decide compiled mixed speed split generation step cudnn profile memory counts)
declare -A LIMIT=([tests]=90 [decide]=420 [compiled]=400 [mixed]=300 [speed]=150 [split]=90 [generation]=180
                  [step]=60 [cudnn]=150 [profile]=150 [memory]=60 [counts]=60)
FORCE=0
STAND_IN=0
LIMITED=()  # the stages given a --limit
BUDGET=0
PACK=
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --force) FORCE=1; shift ;;
        --stand-in) STAND_IN=1; shift ;;
        --budget)
            if [[ ! ${2:-} =~ ^[1-9][0-9]*$ ]]; then
                echo "gpu_suite.sh: --budget takes a whole number of seconds, not '${2:-}'" >&2
                exit 2
            fi
            BUDGET=$2
            shift 2 ;;
        --limit)
            if [[ ! ${2:-} =~ ^([a-z]+)=([1-9][0-9]*)$ || -z ${LIMIT[${BASH_REMATCH[1]}]:-} ]]; then
                echo "gpu_suite.sh: --limit takes STAGE=SECONDS with a stage of ${ALL_STAGES[*]}, not '${2:-}'" >&2
                exit 2
            fi
            LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
            LIMITED+=("${BASH_REMATCH[1]}")
            shift 2 ;;
        --pack)
            if [[ -z ${2:-} ]]; then
                echo "gpu_suite.sh: --pack takes a folder" >&2
                exit 2
            fi
            PACK=$2
            shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_suite.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [[ $# -lt 2 ]]; then
    usage
    exit 2
fi
DATA=$1
OUT=$2
shift 2
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=("${ALL_STAGES[@]}")
for stage in "${STAGES[@]}"; do
    if [[ -z ${LIMIT[$stage]:-} ]]; then
        echo "gpu_suite.sh: unknown stage '$stage' (${ALL_STAGES[*]})" >&2
        exit 2
    fi
done
# on a CPU bf16 trains several times slower than float32: the stand-in outgrows the GPU's limit
[[ $STAND_IN -eq 1 && ! " ${LIMITED[*]} " =~ " decide " ]] && LIMIT[decide]=1800
# a stage asked for alone may take the whole budget, unless given a --limit of its own
if [[ ${#STAGES[@]} -eq 1 && $BUDGET -gt 0 && ! " ${LIMITED[*]} " =~ " ${STAGES[0]} " ]]; then
    LIMIT[${STAGES[0]}]=$BUDGET
fi
if [[ ! -d $DATA ]]; then
    echo "gpu_suite.sh: DATA '$DATA' is not a folder" >&2
    exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
mkdir -p "$OUT" || exit 2
[[ -n $PACK ]] && { mkdir -p "$PACK" && PACK=$(cd "$PACK" && pwd) || exit 2; }
# absolute before moving to the project's root: both may be given from anywhere
DATA=$(cd "$DATA" && pwd) && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$REPO" || exit 2
FAILED=0
# What the figures were measured on, for their report: the GPU, the driver, the versions
{  # appended: a later run that skips existing tables must not rewrite where they came from
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'): gpu_suite.sh ${STAGES[*]}"
    git describe --always --dirty 2>/dev/null || echo "commit ${TPP_COMMIT:-$(cat wheelhouse/tpp-commit.txt 2>/dev/null \
        || echo "unknown (not a git checkout; TPP_COMMIT unset, no wheelhouse/tpp-commit.txt)")}"
    echo "TPP_FAIRSEQ_SPEEDUPS=${TPP_FAIRSEQ_SPEEDUPS-(unset: the defaults of the plugin)}"
    "$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}"); print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1
    "$PY" -c 'import triton; print(f"Triton {triton.__version__}")' 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1 \
        || echo "(no nvidia-smi)"
} >>"$OUT/environment.txt"
{ echo "# gpu_suite.sh: $(date -u '+%Y-%m-%d %H:%M UTC')"; echo; echo '```'; tail -n 6 "$OUT/environment.txt"; echo '```'; } \
    | tee -a "$OUT/summary.md"

DEADLINE=0  # the current stage's, in the suite's SECONDS
GROUP=""  # the process group of the command running now (run() sets it)
RUNNING=""  # "STAGE<tab>FILE" of the command running now, for status.txt if interrupted

end_group() {  # end_group SIGNAL: what is left of the command's process group, ended (10 s at most)
    [[ -z $GROUP ]] && return
    kill "-$1" -- "-$GROUP" 2>/dev/null
    for _ in {1..100}; do kill -0 -- "-$GROUP" 2>/dev/null || { GROUP=""; return; }; sleep 0.1; done
    echo "gpu_suite: processes of process group $GROUP still there 10 s after SIG$1" >&2
}

# interrupted, the suite ends the running command's processes as well (they are in a
# process group of their own, which neither Ctrl-C nor a signal to the suite reaches)
# and packs what it has (a command's table so far in its .progress file)
interrupted() {  # interrupted STATUS: the running command ended and noted, all packed
    end_group TERM
    end_group KILL
    [[ -n $RUNNING ]] && printf '%s\tinterrupted (the suite was stopped)\n' "$RUNNING" >>"$OUT/status.txt"
    pack
    exit "$1"
}
trap 'interrupted 130' INT
trap 'interrupted 143' TERM
trap 'interrupted 129' HUP

run() {  # run STAGE FILE COMMAND...: stdout to OUT/FILE, stderr to OUT/FILE.log
    local stage=$1 file=$2
    shift 2
    if [[ -e $OUT/$file && $FORCE -eq 0 ]]; then
        printf '%s\t%s\tskipped: it exists (--force replaces it)\n' "$stage" "$file" | tee -a "$OUT/status.txt"
        return
    fi
    local left=$((DEADLINE - SECONDS)) why="the stage's limit of ${LIMIT[$stage]}s"
    if [[ $BUDGET -gt 0 && $((BUDGET - SECONDS)) -le $left ]]; then
        left=$((BUDGET - SECONDS))
        why="the budget of ${BUDGET}s"
    fi
    if [[ $left -le 0 ]]; then
        FAILED=1
        printf '%s\t%s\tnot run: %s is spent\n' "$stage" "$file" "$why" | tee -a "$OUT/status.txt"
        return
    fi
    if declare -F "$1" >/dev/null; then  # a function of this script (exported below)
        set -- bash -c '"$@"' _ "$@"
    fi
    local start=$SECONDS
    # timeout signals the command's whole process group, the processes it started too,
    # and returns when the command has ended: what is left of the group (a data loader's
    # worker still ending) is ended before anything else runs
    RUNNING="$stage"$'\t'"$file"
    timeout --kill-after=10 "$left" "$@" >"$OUT/$file.partial" 2>"$OUT/$file.log" &
    GROUP=$!  # timeout's process id, and its process group's
    wait "$GROUP"
    local rc=$?
    end_group KILL
    GROUP=""
    RUNNING=""
    if [[ $rc -eq 0 ]]; then
        mv -f "$OUT/$file.partial" "$OUT/$file"
    else
        FAILED=1
    fi
    local note=""  # timeout's statuses: 124 when it stopped the command, 137 when it killed it
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        note=" (stopped: $why ran out)"
    fi
    printf '%s\t%s\texit %d\t%ds%s\n' "$stage" "$file" "$rc" $((SECONDS - start)) "$note" \
        | tee -a "$OUT/status.txt"
}

output() {  # output FILE [LINES]: a command's table, or what it wrote before it stopped and why
    local f last
    if [[ -e $OUT/$1 ]]; then  # (kept where a command run again with --force failed)
        last=$(awk -F'\t' -v f="$1" '$2 == f { s = $3 } END { print s }' "$OUT/status.txt")
        [[ $last == "exit 0" || $last == skipped* ]] || echo "($1 is an earlier run's: this one ended: $last)"
        tail -n "${2:-60}" "$OUT/$1"
        return
    fi
    for f in "$OUT/$1.progress" "$OUT/$1.partial" ""; do
        if [[ -z $f ]]; then
            echo "($1: no output)"
        elif [[ -s $f ]]; then
            echo "(${f##*/}: the command did not finish)"
            tail -n "${2:-60}" "$f"
            break
        fi
    done
    if [[ -s $OUT/$1.log ]]; then
        echo "(the end of $1.log)"
        grep -v -i 'warning' "$OUT/$1.log" | tail -n 6
    fi
}

train_table() {  # train_table RUN...: the fairseq-train runs' table, and why each failed run failed
    local pairs=() name
    for name in "$@"; do pairs+=("$name=$OUT/mixed_$name.txt"); done
    "$PY" -m benchmarks.fairseq_train_run table "${pairs[@]}" 2>&1
    for name in "$@"; do  # the last line of its errors
        if [[ ! -e $OUT/mixed_$name.txt && -s $OUT/mixed_$name.txt.log ]]; then
            echo "$name: $(grep -v -i warning "$OUT/mixed_$name.txt.log" | grep . | tail -n 1)"
        fi
    done
}

summarize() {  # summarize STAGE: its table, appended to OUT/summary.md and printed
    local stage=$1
    {
        echo
        echo "## $stage"
        echo
        awk -F'\t' -v s="$stage" '$1 == s { print "    " $2 ": " $3 ($4 ? ", " $4 : "") }' "$OUT/status.txt" \
            | tail -n 12
        echo
        case $stage in
        tests) output tests.txt 25 ;;
        decide) ;;  # each table as its command ends (decided)
        compiled) output compiled.md ;;
        mixed) train_table "${MIXED_RUNS[@]}" ;;
        speed) output speed.md ;;
        generation) output generation_30.md; echo; output generation_100.md ;;
        cudnn) train_table transformer_bf16 transformer_bf16_cudnn; echo; output cudnn.md ;;
        split) output split.md ;;
        profile) output profile_train.md 40; echo; output profile_30.md 30; echo; output profile_100.md 30 ;;
        memory) output memory.md ;;
        counts) output counts.md ;;
        step) output step.md ;;
        esac
    } | tee -a "$OUT/summary.md"
}

pack() {  # what a machine that returns few files sends back, after every stage
    [[ -z $PACK ]] && return
    cp "$OUT/summary.md" "$OUT/status.txt" "$PACK/" 2>/dev/null
    tar -czf "$PACK/gpu_results.tar.gz.tmp" -C "$OUT" . && mv -f "$PACK/gpu_results.tar.gz.tmp" "$PACK/gpu_results.tar.gz"
}

decided() {  # decided FILE: one of the decide stage's tables, printed, appended and packed
    { echo; echo "### decide: $1"; echo; output "$1"; } | tee -a "$OUT/summary.md"
    pack
}

BENCH=("$PY" -m benchmarks.bench_model --data "$DATA" --device cuda --dtype bf16 --sizes 1024)
# the decide stage: the same commands on a GPU or, --stand-in, small on the CPU
# At base size a step is short and bound by the host, its time spread wide: more rounds
# there. On the GPU every run's rounds are whole cycles of the turns' orders (as many rounds
# as models, twice as many for an odd number: harness.turn_order), so that each takes every
# place and follows every other equally often (the stand-in's two rounds are too few).
DEVICE=cuda BASE=512 BASE_TOKENS=8192 BIG=1024 BIG_TOKENS=16384 ROUNDS=8 LAYERS=6 COLLECT=() STAND=()
BASE_ROUNDS=32 SYNC_ROUNDS=30 FP32_ROUNDS=24 COMPILED_ROUNDS=12
if [[ $STAND_IN -eq 1 ]]; then  # the kernels never in the interpreter: it would take hours
    DEVICE=cpu BASE=128 BASE_TOKENS=1024 BIG=256 BIG_TOKENS=512 ROUNDS=2 LAYERS=2
    BASE_ROUNDS=2 SYNC_ROUNDS=2 FP32_ROUNDS=2 COMPILED_ROUNDS=2
    COLLECT=(--collect-only) STAND=(env TRITON_INTERPRET=0)
fi
DECIDE=("${STAND[@]}" "$PY" -m benchmarks.bench_model --data "$DATA" --device "$DEVICE" --layers "$LAYERS" --no-generation
        --no-memory --warmup 2)
DECIDE_MODELS=transformer,transformer-b,tpp,tpp-fused
MODELS=transformer,transformer-b,tpp,tpp-taps
MIXED_UPDATES=${MIXED_UPDATES:-150}
# name, model, options: the order is that of what they decide
MIXED_RUNS=(transformer_fp32 transformer_bf16 tpp_fp32 tpp_bf16 tpp_bf16_taps transformer_fp16 tpp_fp16
            tpp_mefp16)
declare -A MIXED=(
    [transformer_fp32]="transformer" [transformer_bf16]="transformer --bf16"
    [tpp_fp32]="tpp" [tpp_bf16]="tpp --bf16"
    [transformer_fp16]="transformer --fp16" [tpp_fp16]="tpp --fp16"
    [transformer_bf16_cudnn]="transformer --speedups flat-bf16 --bf16"
    [tpp_bf16_taps]="tpp --bf16 --conv-heads-impl taps"
    [tpp_mefp16]="tpp --memory-efficient-fp16")

mixed() {  # mixed MODEL [--speedups NAMES] OPTIONS...: fairseq-train, base size, 6+6 layers
    local model=$1
    shift
    if [[ ${1:-} == --speedups ]]; then  # TPP_FAIRSEQ_SPEEDUPS, read by the plugin when it is loaded
        export TPP_FAIRSEQ_SPEEDUPS=$2
        shift 2
    fi
    [[ $model == tpp ]] && model=tpp-tags  # with its tag losses (POS after layer 1, NER after layer 2)
    # bench_model.py's command line: the same size, layers and dropouts for both models
    "$PY" -m benchmarks.fairseq_train_run model "$DATA" "$model" --size 512 --layers 6 --max-tokens 8192 \
        --updates "$MIXED_UPDATES" -- --lr 7e-4 --warmup-updates 100 "$@"
}
export -f mixed  # run() starts it through bash, under timeout
export PY DATA OUT MIXED_UPDATES

for stage in "${STAGES[@]}"; do
    DEADLINE=$((SECONDS + LIMIT[$stage]))
    if [[ $BUDGET -gt 0 && $BUDGET -lt $DEADLINE ]]; then
        echo "== $stage: up to $((BUDGET - SECONDS)) s (what is left of the budget)"
    else
        echo "== $stage: up to ${LIMIT[$stage]} s (its limit)"
    fi
    case $stage in
    tests)  # the ahead-of-time compile test is for machines without a GPU
        run tests tests.txt "$PY" -m pytest -q -p no:cacheprovider --tb=line -rfE \
            tests/plugin/test_cuda.py tests/plugin/test_conv_heads_triton.py -k "not hopper" ;;
    decide)  # the two tables that decide the fused kernels first, then their tests on CUDA
        run decide decide_base.md "${DECIDE[@]}" --dtype bf16 --sizes "$BASE" --max-tokens "$BASE_TOKENS" \
            --update-freq 1 --rounds "$BASE_ROUNDS" --mfu --models "$DECIDE_MODELS" \
            --partial "$OUT/decide_base.md.progress" --json "$OUT/decide_base.json"
        decided decide_base.md
        run decide decide_big.md "${DECIDE[@]}" --dtype bf16 --sizes "$BIG" --max-tokens "$BIG_TOKENS" \
            --update-freq 2 --rounds "$ROUNDS" --mfu --models "$DECIDE_MODELS" --partial "$OUT/decide_big.md.progress"
        decided decide_big.md
        run decide decide_tests.txt "$PY" -m pytest -q -p no:cacheprovider --tb=line -rfE "${COLLECT[@]}" \
            tests/plugin/test_query_triton.py
        decided decide_tests.txt
        run decide decide_sync.md "${DECIDE[@]}" --dtype bf16 --sizes "$BASE" --max-tokens "$BASE_TOKENS" \
            --update-freq 1 --rounds "$SYNC_ROUNDS" \
            --models transformer,transformer-b,transformer-sync,tpp-fused,tpp-fused-sync \
            --partial "$OUT/decide_sync.md.progress"
        decided decide_sync.md
        run decide decide_counts.md "${STAND[@]}" "$PY" -m benchmarks.count_ops --data "$DATA" --device "$DEVICE" --dtype bf16 \
            --size "$BIG" --layers "$LAYERS" --max-tokens "$BIG_TOKENS" --models transformer,transformer-sync,tpp,tpp-fused
        decided decide_counts.md
        run decide decide_fp32.md "${DECIDE[@]}" --dtype fp32 --no-tf32 --sizes "$BASE" --max-tokens "$BASE_TOKENS" \
            --update-freq 1 --rounds "$FP32_ROUNDS" --models transformer,tpp,tpp-fused \
            --partial "$OUT/decide_fp32.md.progress" --json "$OUT/decide_fp32.json"
        decided decide_fp32.md
        run decide decide_precision.md "$PY" -m benchmarks.precision_ratio "$OUT/decide_base.json" "$OUT/decide_fp32.json"
        decided decide_precision.md ;;
    compiled)
        run compiled compiled.md "${DECIDE[@]}" --dtype bf16 --sizes "$BASE" --max-tokens "$BASE_TOKENS" \
            --update-freq 1 --rounds "$COMPILED_ROUNDS" --mfu --partial "$OUT/compiled.md.progress" \
            --models transformer,transformer-b,transformer-compiled,tpp-fused,tpp-compiled,tpp-fused-compiled ;;
    mixed)
        for name in "${MIXED_RUNS[@]}"; do
            # shellcheck disable=SC2086  # the options are words
            run mixed "mixed_$name.txt" mixed ${MIXED[$name]}
        done ;;
    speed)
        run speed speed.md "${BENCH[@]}" --rounds 8 --mfu --no-generation --models "$MODELS" \
            --partial "$OUT/speed.md.progress" --json "$OUT/speed.json" ;;
    generation)
        run generation generation_30.md "${BENCH[@]}" --no-training --gen-len 30 --gen-batches 6 --models "$MODELS"
        run generation generation_100.md "${BENCH[@]}" --no-training --gen-len 100 --gen-batches 5 --models "$MODELS" ;;
    cudnn)  # the mixed stage's transformer_bf16 with cuDNN's attention kept on
        # shellcheck disable=SC2086  # the options are words
        run cudnn mixed_transformer_bf16_cudnn.txt mixed ${MIXED[transformer_bf16_cudnn]}
        run cudnn cudnn.md "${BENCH[@]}" --rounds 8 --no-generation --cudnn-attention --models "$MODELS" \
            --partial "$OUT/cudnn.md.progress" ;;
    split)
        run split split.md "${BENCH[@]}" --rounds 10 --mfu --no-generation \
            --models transformer,transformer-split,transformer-b,tpp,tpp-split --partial "$OUT/split.md.progress" ;;
    profile)
        run profile profile_train.md "$PY" -m benchmarks.profile_model --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --models transformer,tpp
        run profile profile_30.md "$PY" -m benchmarks.profile_model --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --generation
        run profile profile_100.md "$PY" -m benchmarks.profile_model --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --generation --gen-len 100 ;;
    memory)
        run memory memory.md "$PY" -m benchmarks.kept_for_backward --data "$DATA" --device cuda --dtype bf16 \
            --size 1024 --max-tokens 16384 ;;
    counts)
        run counts counts.md "$PY" -m benchmarks.count_ops --data "$DATA" --device cuda --dtype bf16 --size 1024 \
            --models transformer,tpp,tpp-taps ;;
    step)
        run step step.md "$PY" -m benchmarks.bench_decode_step --device cuda --dtype bf16 --dim 1024 --rows 5,640 \
            --models mha,mha-b,tpp,tpp-triton,tpp-general ;;
    esac
    summarize "$stage"
    if [[ $stage == decide ]]; then  # the deciding ratios again, in the output's last lines
        for table in decide_base.md decide_big.md; do
            [[ -s $OUT/$table ]] && { echo; echo "### decide: $table (again)"; echo; output "$table"; }
        done
    fi
    pack
done
echo "gpu_suite.sh: logs and tables in $OUT (status.txt: one line per command; summary.md: every table)"
exit $FAILED
