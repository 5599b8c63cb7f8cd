#!/usr/bin/env bash
# The quality study's share of one short GPU allocation on a node without internet: the
# runs named by --only trained at once, averaged, translated and scored, their records
# (no checkpoints) packed into RESULTS, to be merged with earlier allocations' records
# by `tpp-study --records ... --report-only` on any machine (docs/gpu_commands.md).
#
# Usage, from the checkout on the node, with what benchmarks/gpu_prepare.sh made beside it:
#   benchmarks/gpu_study.sh --budget SECONDS --results DIR --only RUN,... [tpp-study options]
#
#   --budget   seconds this command may take in all, install included; the study is
#              stopped in time to pack what finished (default 540)
#   --results  a folder copied back from the node: records.tar.gz (the finished runs' records and
#              translations; records-2.tar.gz where one is there already), logs.tar.gz
#              (every run's logs, finished or not), study.log, install.log, device.txt
#   --only     the runs to train, e.g. transformer-s1,hybrid-s1,hybrid+tags-s1; as many
#              go at once (--parallel)
# Other options go to tpp-study (e.g. --records records/gpu, to skip runs already
# recorded); its configuration is --config gpu on data-bin/gpu_ende with the conv heads'
# output scaled, seeds 1 and 2, on the GPU (--device cuda: where torch sees no GPU, the
# study stops at once). The records name the code's commit: TPP_COMMIT, else the
# one gpu_prepare.sh wrote into wheelhouse/tpp-commit.txt (the node's copy has no history).
set -uo pipefail

BUDGET=540
RESULTS=
ONLY=
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "gpu_study.sh: error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --budget|--results|--only) [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value" ;;
    esac
    case $1 in
        --budget) BUDGET=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
[[ -n $RESULTS && -n $ONLY ]] || { usage; exit 2; }
[[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget is a whole number of seconds, not '$BUDGET'"
mkdir -p "$RESULTS" || exit 2
RESULTS=$(realpath "$RESULTS")  # (before leaving the folder it was given from)
cd "$(dirname "$0")/.."
[[ -n ${TPP_COMMIT:-} || ! -f wheelhouse/tpp-commit.txt ]] || export TPP_COMMIT=$(<wheelhouse/tpp-commit.txt)
stamp() { echo "[gpu_study $(date +%H:%M:%S) +${SECONDS}s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RESULTS/device.txt" 2>&1
[[ -d data-bin/gpu_ende ]] || tar -xJf data-bin/gpu_ende.tar.xz -C data-bin || exit 1
stamp "installing"
# (a second call on the same node reuses the environment, if the first one finished it)
/tmp/tpp/bin/python -c 'import fairseq, tpp_plugin' 2>/dev/null || scripts/setup_env.sh --from-wheelhouse wheelhouse --venv /tmp/tpp \
    --system-site-packages --fairseq-extensions text >"$RESULTS/install.log" 2>&1 || {
    tail -20 "$RESULTS/install.log"; exit 1; }
stamp "installed"
/tmp/tpp/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' \
    >>"$RESULTS/device.txt" 2>&1

runs=$(( $(tr -cd , <<<"$ONLY" | wc -c) + 1 ))
study=(/tmp/tpp/bin/tpp-study --config gpu --data data-bin/gpu_ende --seeds 1,2 --device cuda --out runs/study_gpu
    --test-reference data-bin/gpu_ende/raw/test.de --test-source data-bin/gpu_ende/raw/test.en
    --conv-head-scaling inv-sqrt-head-dim --parallel "$runs" --only "$ONLY" --step-timeout 150)
# what stopping the study, the pack and the logs take at the end
MARGIN=60
for try in 1 2; do  # a run that failed (e.g. out of memory beside the others) is tried once more
    left=$((BUDGET - MARGIN - SECONDS))
    (( left > 60 )) || break
    stamp "study, try $try, ${left}s left"
    timeout -k 20 "$left" "${study[@]}" "$@" >>"$RESULTS/study.log" 2>&1 && break
done
stamp "packing"
pack=$RESULTS/records.tar.gz  # (a second call into the same RESULTS packs beside the first)
for n in 2 3 4 5 6 7 8 9; do [[ -e $pack ]] && pack=$RESULTS/records-$n.tar.gz; done
# (the records are packed before the report is written: a report cut short loses none)
left=$((BUDGET - 25 - SECONDS)); (( left > 10 )) || left=10
timeout -k 5 "$left" "${study[@]}" --report-only --pack "$pack" "$@" >>"$RESULTS/study.log" 2>&1 ||
    [[ -e $pack ]] || { stamp "packing failed:"; tail -5 "$RESULTS/study.log"; }
tar -czf "$RESULTS/logs.tar.gz" --exclude='*.pt' --exclude='hyp*' --exclude='*.detok' \
    --exclude='*.tok' --exclude=eval runs/study_gpu/runs 2>/dev/null
grep -h '^\[study' "$RESULTS/study.log" | tail -40

# with the time left: one finished run's test set translated alone in float32 and in
# float16, timed (does float16 decoding change the scores?)
avg=$(ls runs/study_gpu/runs/*/checkpoint_avg.pt 2>/dev/null | head -1)
if [[ -n $avg ]] && (( BUDGET - 20 - SECONDS > 100 )); then
    for precision in fp32 fp16; do
        left=$((BUDGET - 20 - SECONDS))
        (( left > 30 )) || break
        flags=(); [[ $precision == fp16 ]] && flags=(-- --fp16)
        begun=$SECONDS
        timeout "$left" /tmp/tpp/bin/tpp-evaluate --data data-bin/gpu_ende --checkpoint "$avg" \
            --reference data-bin/gpu_ende/raw/test.de --out "runs/decode_$precision" --force \
            --max-tokens 8192 "${flags[@]}" >>"$RESULTS/decode.log" 2>&1 \
            && echo "$avg $precision $((SECONDS - begun)) s: $(grep '^sacrebleu_detok:' "runs/decode_$precision/bleu.txt")" \
            | tee -a "$RESULTS/decode.txt"
    done
fi
stamp "done"
