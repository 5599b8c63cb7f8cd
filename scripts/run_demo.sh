#!/usr/bin/env bash
# The whole Transformer++ pipeline on the shipped English-German sample, on the CPU:
#
#   prepare (Moses tokenisation) -> tag with spaCy (POS/NER) -> joint BPE -> binarize
#   -> train a small transformer_pp with the tag losses -> average the last checkpoints
#   -> translate the test set (beam 5) -> sacreBLEU -> plots and attention maps
#
# Usage:  scripts/run_demo.sh [--out DIR] [--max-update N] [--train-lines N] [--force]
#         (the README's first command, `make demo`, runs it with the defaults)
#
#   --out DIR          where everything goes [runs/demo]
#   --max-update N     training updates [DEMO_MAX_UPDATE or 500]
#   --train-lines N    use only the first N training pairs (quick runs, tests) [all]
#   --heldout-lines N  use only the first N valid and test pairs (quick runs, tests) [all]
#   --save-every N     checkpoint interval in updates [DEMO_SAVE_EVERY or max-update/10]
#   --average N        how many of the last checkpoints to average [5]
#   --force            start again from scratch (removes --out)
#
# Re-running reuses every finished stage: the data pipeline skips its completed steps,
# fairseq-train resumes from checkpoint_last.pt (and stops at once when it is done), and
# averaging, evaluation and plots are skipped when their outputs exist.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python}
command -v fairseq-train >/dev/null || { echo "run_demo.sh: fairseq-train not on PATH: run 'make demo' (it sets up the environment)" >&2; exit 2; }

out=runs/demo
max_update=${DEMO_MAX_UPDATE:-500}
train_lines=
heldout_lines=
save_every=${DEMO_SAVE_EVERY:-}
average=5
force=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --max-update) max_update=$2; shift 2 ;;
    --train-lines) train_lines=$2; shift 2 ;;
    --heldout-lines) heldout_lines=$2; shift 2 ;;
    --save-every) save_every=$2; shift 2 ;;
    --average) average=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $save_every ]] || save_every=$(( max_update / 10 > 0 ? max_update / 10 : 1 ))
if (( force )); then rm -rf "$out"; fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
started=$SECONDS
stage() { printf '\n=== [%s] %s (%ds elapsed)\n' "$1" "$2" $(( SECONDS - started )); }

# --------------------------------------------------------------------------- 1. data
sample=data/sample
if [[ -n $train_lines || -n $heldout_lines ]]; then
  # a cut-down copy of the sample (first lines of each split)
  mkdir -p "$out/sample"
  for l in en de; do
    for split in train valid test; do
      n=$heldout_lines; [[ $split == train ]] && n=$train_lines
      target=$out/sample/$split.$l
      [[ -s $target ]] && continue
      if [[ -n $n ]]; then head -n "$n" "$sample/$split.$l" > "$target.tmp"; else cp "$sample/$split.$l" "$target.tmp"; fi
      mv "$target.tmp" "$target"
    done
  done
  sample=$out/sample
fi
stage 1/6 "prepare, tag (spaCy), BPE and binarize $sample"
"$python" -m tpp_pipeline.pipeline -s en -t de \
  --trainpref "$sample/train" --validpref "$sample/valid" --testpref "$sample/test" \
  --name sample_en_de --work-dir "$out/work" --data-bin "$out/data-bin" \
  --bpe-merges "${DEMO_BPE_MERGES:-8000}" --workers "$(nproc)"
data=$out/data-bin/sample_en_de

# --------------------------------------------------------------------------- 2. train
stage 2/6 "train transformer_pp (tiny preset, d=256, 3+3 layers) with POS/NER losses for $max_update updates"
ckpt=$out/checkpoints
mkdir -p "$ckpt"
done_updates=0
if [[ -s $ckpt/checkpoint_last.pt ]]; then
  done_updates=$("$python" - "$ckpt/checkpoint_last.pt" <<'PY'
import sys, torch, tpp_plugin  # the plugin allow-lists fairseq's checkpoint contents
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
print(state["optimizer_history"][-1]["num_updates"])
PY
)
fi
if (( done_updates >= max_update )); then
  echo "reusing $ckpt (trained for $done_updates updates)"
else
bash scripts/train.sh --preset tiny --data "$data" --save-dir "$ckpt" --cpu \
  --max-update "$max_update" --update-freq 1 --max-tokens "${DEMO_MAX_TOKENS:-4096}" \
  --warmup-updates "$(( max_update / 6 > 0 ? max_update / 6 : 1 ))" --lr 1e-3 \
  --save-interval-updates "$save_every" --keep-interval-updates "$average" --log-interval 25 -- \
  --encoder-embed-dim 256 --encoder-ffn-embed-dim 512 --encoder-layers 3 --decoder-layers 3 \
  --encoder-conv-kernel-sizes 3,5,7 --decoder-conv-kernel-sizes 3,5,7 \
  --encoder-conv-dilations 1,1,2 --decoder-conv-dilations 1,1,2 --dropout 0.2 \
  --share-all-embeddings --log-format json --log-file "$ckpt/train.log" --no-progress-bar \
  --num-workers 0 --validate-interval-updates "$(( max_update / 6 > 0 ? max_update / 6 : 1 ))"
fi

# --------------------------------------------------------------------------- 3. average
stage 3/6 "average the last $average checkpoints"
avg=$ckpt/checkpoint_avg.pt
if [[ -s $avg && $avg -nt $ckpt/checkpoint_last.pt ]]; then
  echo "reusing $avg"
else
  # fairseq writes no checkpoint_<epoch>_<update>.pt when an interval ends an epoch,
  # so there may be fewer than asked for: average those there are
  shopt -s nullglob
  interval=("$ckpt"/checkpoint_*_*.pt)
  shopt -u nullglob
  n=${#interval[@]}
  (( n > 0 )) || { echo "run_demo.sh: no checkpoint_<epoch>_<update>.pt in $ckpt to average" >&2; exit 1; }
  "$python" -m tpp_tools.average --inputs "$ckpt" \
    --num-update-checkpoints "$(( n < average ? n : average ))" --output "$avg" --force
fi

# --------------------------------------------------------------------------- 4. evaluate
stage 4/6 "translate the test set (beam 5, length penalty 0.5) and score it"
eval_dir=$out/eval
if [[ -s $eval_dir/bleu.txt && $eval_dir/bleu.txt -nt $avg ]]; then
  echo "reusing $eval_dir/bleu.txt"
else
  "$python" -m tpp_tools.evaluate --data "$data" --checkpoint "$avg" --reference "$sample/test.de" \
    --out "$eval_dir" --cpu --force
fi

# --------------------------------------------------------------------------- 5. plots
stage 5/6 "training curves"
if ! ls "$out"/plots/*.png >/dev/null 2>&1 || [[ $ckpt/train.log -nt $out/plots ]]; then
  "$python" -m tpp_tools.plot_training --log "$ckpt/train.log" --out-dir "$out/plots" --force
fi

# --------------------------------------------------------------------------- 6. attention
stage 6/6 "attention maps and the paper's fire/mountain similarity"
sentence=${DEMO_SENTENCE:-"There is a fire in the mountain."}
if ! ls "$out"/attention/*.png >/dev/null 2>&1 || [[ $avg -nt $out/attention ]]; then
  "$python" -m tpp_tools.plot_attention --path "$avg" --data "$data" \
    --bpe-codes "$out/work/bpe/codes" --sentence "$sentence" --out-dir "$out/attention" --force
fi
"$python" -m tpp_tools.embedding_similarity --path "$avg" --data "$data" \
  --bpe-codes "$out/work/bpe/codes" --sentence "$sentence" --words fire mountain \
  | tee "$out/fire_mountain.txt" || echo "(similarity: the words are not single tokens of this model's vocabulary)"

printf '\n=== done in %ds\n' $(( SECONDS - started ))
cat <<EOF
  data:            $data
  checkpoints:     $ckpt   (averaged: $avg)
  translations:    $eval_dir/generate-test.txt
  scores:          $eval_dir/bleu.txt
  training curves: $out/plots
  attention maps:  $out/attention
EOF
echo
cat "$eval_dir/bleu.txt"
