#!/usr/bin/env bash
# Translate a binarized split with fairseq-generate and score it two ways.
#
# Usage:
#   scripts/evaluate.sh --data DIR --checkpoint FILE --reference RAW_REF --out DIR [options] [-- extra fairseq-generate options]
#
#   scripts/evaluate.sh --data data-bin/wmt14_en_de --checkpoint checkpoints/en-de/checkpoint_avg10.pt \
#       --reference work/wmt14_en_de/raw/newstest2014.de --out results/en_de_test
#
# Options (variable in capitals, default in brackets; a flag beats the variable):
#   --data DIR           DATA_BIN     binarized data folder (fairseq-preprocess output)
#   --checkpoint FILE    CHECKPOINT   model to load (e.g. the averaged checkpoint)
#   --reference FILE     REFERENCE    raw, untokenised reference, one sentence per line, in
#                                     the order of the split (e.g. newstest2014.de)
#   --out DIR            OUT_DIR      where results go; bleu.txt is refused if it exists
#   --split NAME         SPLIT [test]
#   --source-lang L      SRC_LANG     [inferred by fairseq from the data folder]
#   --target-lang L      TGT_LANG     [inferred from the data folder file names]
#   --beam N             BEAM [5]
#   --lenpen A           LENPEN [0.5]
#   --max-tokens N       MAX_TOKENS [4096]
#   --task NAME          TASK [translation]: the model needs no tags at inference
#   --user-dir DIR       USER_DIR [<repo>/tpp_plugin]
#   --cpu                CPU [0]
#   --force              replace the results of an earlier run in --out
#
# Scores, written to <out>/bleu.txt and printed:
#  1. detokenised sacreBLEU: hypotheses with BPE removed (--remove-bpe), Moses-detokenised
#     (sacremoses), scored by sacreBLEU against the raw reference with its default 13a
#     tokenisation; the signature is printed so the number can be compared across papers.
#  2. tokenised BLEU with compound splitting, the convention of "Attention is all you
#     need" and fairseq's compound_split_bleu.sh, which is how the paper's table was
#     computed: hypothesis and the tokenised reference (the binarized target, BPE
#     removed) both get "a-b" rewritten as "a ##AT##-##AT## b", then BLEU on those
#     tokens as they are (sacreBLEU --tokenize none --smooth-method none, as multi-bleu).
# Files in <out>: generate-<split>.txt (fairseq's output), hyp.tok, ref.tok, hyp.detok,
# hyp.tok.split, ref.tok.split, bleu.txt.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "evaluate.sh: error: $*" >&2; exit 2; }

force=0
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --data) DATA_BIN=$2; shift 2 ;;
    --checkpoint) CHECKPOINT=$2; shift 2 ;;
    --reference) REFERENCE=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --split) SPLIT=$2; shift 2 ;;
    --source-lang) SRC_LANG=$2; shift 2 ;;
    --target-lang) TGT_LANG=$2; shift 2 ;;
    --beam) BEAM=$2; shift 2 ;;
    --lenpen) LENPEN=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --task) TASK=$2; shift 2 ;;
    --user-dir) USER_DIR=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --force) force=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (fairseq-generate options go after '--'; see --help)" ;;
  esac
done

[[ -n ${DATA_BIN:-} ]] || die "--data is required"
[[ -n ${CHECKPOINT:-} ]] || die "--checkpoint is required"
[[ -n ${REFERENCE:-} ]] || die "--reference is required"
[[ -n ${OUT_DIR:-} ]] || die "--out is required"
SPLIT=${SPLIT:-test}
BEAM=${BEAM:-5}
LENPEN=${LENPEN:-0.5}
MAX_TOKENS=${MAX_TOKENS:-4096}
TASK=${TASK:-translation}
USER_DIR=${USER_DIR:-$repo/tpp_plugin}
CPU=${CPU:-0}
PYTHON=${PYTHON:-python}
FAIRSEQ_GENERATE=${FAIRSEQ_GENERATE:-fairseq-generate}
SACREBLEU=${SACREBLEU:-sacrebleu}

[[ -d $DATA_BIN ]] || die "data folder '$DATA_BIN' does not exist"
[[ -f $CHECKPOINT ]] || die "checkpoint '$CHECKPOINT' does not exist"
[[ -f $REFERENCE ]] || die "reference '$REFERENCE' does not exist"
if [[ -z ${TGT_LANG:-} ]]; then
  # fairseq-preprocess writes dict.<src>.txt and dict.<tgt>.txt; the target is whichever
  # language the split's .idx files name second (<split>.<src>-<tgt>.<tgt>.idx)
  idx=$(cd "$DATA_BIN" && ls "$SPLIT".*-*.*.idx 2>/dev/null | head -n 1 || true)
  [[ -n $idx ]] || die "no '$SPLIT' split in '$DATA_BIN' (expected $SPLIT.<src>-<tgt>.<lang>.idx)"
  pair=${idx#"$SPLIT".}; pair=${pair%%.*}
  TGT_LANG=${pair#*-}
  SRC_LANG=${SRC_LANG:-${pair%-*}}
fi
lang_args=()
[[ -n ${SRC_LANG:-} ]] && lang_args+=(--source-lang "$SRC_LANG")
lang_args+=(--target-lang "$TGT_LANG")

mkdir -p "$OUT_DIR"
bleu_file=$OUT_DIR/bleu.txt
if [[ -e $bleu_file && $force != 1 ]]; then
  die "'$bleu_file' already exists (use --force to evaluate again into '$OUT_DIR')"
fi
rm -f "$bleu_file"

device=()
[[ $CPU == 1 ]] && device=(--cpu)
generated=$OUT_DIR/generate-$SPLIT.txt
# complete files only: outputs are written under .tmp names and renamed at the end
trap 'rm -f "$generated.tmp" "$bleu_file.tmp"' EXIT
echo "evaluate.sh: translating $DATA_BIN:$SPLIT with $CHECKPOINT (beam $BEAM, lenpen $LENPEN)" >&2
"$FAIRSEQ_GENERATE" "$DATA_BIN" --user-dir "$USER_DIR" --task "$TASK" "${lang_args[@]}" \
  --path "$CHECKPOINT" --gen-subset "$SPLIT" --beam "$BEAM" --lenpen "$LENPEN" \
  --max-tokens "$MAX_TOKENS" --remove-bpe "${device[@]}" "${extra[@]}" > "$generated.tmp"
mv "$generated.tmp" "$generated"

# fairseq prints sentences in batch order; sort by sentence id to get the corpus order.
# H-<id> <score> <tokens> is the hypothesis, T-<id> <tokens> the (tokenised) target.
grep '^H-' "$generated" | sed 's/^H-//' | sort -t$'\t' -k1,1n | cut -f3- > "$OUT_DIR/hyp.tok"
grep '^T-' "$generated" | sed 's/^T-//' | sort -t$'\t' -k1,1n | cut -f2- > "$OUT_DIR/ref.tok"
hyps=$(wc -l < "$OUT_DIR/hyp.tok")
refs=$(wc -l < "$REFERENCE")
if [[ $hyps -ne $refs ]]; then
  die "$hyps hypotheses for '$SPLIT' but $refs lines in reference '$REFERENCE' (wrong split or reference?)"
fi

# (a) detokenised sacreBLEU against the raw reference
"$PYTHON" "$repo/scripts/detokenize_moses.py" -l "$TGT_LANG" < "$OUT_DIR/hyp.tok" > "$OUT_DIR/hyp.detok"
detok_line=$("$SACREBLEU" "$REFERENCE" -i "$OUT_DIR/hyp.detok" -m bleu -f text -w 2)

# (b) tokenised BLEU with compound splitting: the convention's s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g;
# text tokenised with Moses' aggressive hyphen splitting ("a @-@ b") ends up the same way.
split_compounds() { sed -E -e 's/(\S)-(\S)/\1 ##AT##-##AT## \2/g' -e 's/ @ ##AT##-##AT## @ / ##AT##-##AT## /g'; }
split_compounds < "$OUT_DIR/hyp.tok" > "$OUT_DIR/hyp.tok.split"
split_compounds < "$OUT_DIR/ref.tok" > "$OUT_DIR/ref.tok.split"
tok_line=$("$SACREBLEU" "$OUT_DIR/ref.tok.split" -i "$OUT_DIR/hyp.tok.split" -m bleu -f text -w 2 \
  --tokenize none --smooth-method none)

# sacreBLEU's text line: "BLEU|nrefs:1|...|version:X = 27.31 58.9/33.1/... (BP = ...)"
score_of() { awk '{print $3}' <<< "$1"; }
signature_of() { awk '{print $1}' <<< "$1" | sed 's/^BLEU|//'; }
{
  echo "checkpoint: $CHECKPOINT"
  echo "data: $DATA_BIN split $SPLIT (${SRC_LANG:-?}-$TGT_LANG), beam $BEAM, lenpen $LENPEN, $hyps sentences"
  echo "sacrebleu_detok: $(score_of "$detok_line")"
  echo "sacrebleu_detok_signature: $(signature_of "$detok_line")"
  echo "sacrebleu_detok_full: $detok_line"
  echo "bleu_tok_compound_split: $(score_of "$tok_line")"
  echo "bleu_tok_compound_split_signature: $(signature_of "$tok_line")"
  echo "bleu_tok_compound_split_full: $tok_line"
} > "$bleu_file.tmp"
mv "$bleu_file.tmp" "$bleu_file"
cat "$bleu_file"
