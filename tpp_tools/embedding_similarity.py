"""Cosine similarity of two words of a sentence in each encoder layer's two kinds of
self-attention representation.

    tpp-embedding-similarity --path runs/demo/checkpoints/checkpoint_avg.pt \\
        --data runs/demo/data-bin/sample_en_de --bpe-codes runs/demo/work/bpe/codes
    tpp-embedding-similarity --path checkpoints/en-de/checkpoint_avg10.pt \\
        --data data-bin/wmt14_en_de \\
        --bpe-codes work/wmt14_en_de/bpe/codes \\
        --sentence "There is a fire in the mountain." --words fire mountain

The paper argues that in "There is a fire in the mountain" the words "fire" and
"mountain" are related through the sentence, not through their neighbourhoods, and
that the two kinds of head capture this differently. For every encoder layer with
hybrid self-attention this prints the cosine similarity of the two words in

* the dot-product heads' output: softmax(Q K^T / sqrt(d_h)) V of the H_a dot-product
  heads, concatenated (before the output projection W^O);
* the convolution heads' local representation: LocalConv(S), the paper's equation 2
  (pointwise projection, then the causal, dilated, softmax-normalised depthwise
  convolution; with ``--conv-head-scaling``, times a constant, which a cosine does not
  see), before it is combined with the context Query;
* for reference, the layer's output.

A word split into several BPE pieces is represented by the mean of its pieces.
"""

from __future__ import annotations

import argparse
import sys

from tpp_pipeline.lock import exit_cleanly_on_sigterm
from tpp_pipeline.errors import report

from .analysis_model import (
    AnalysisError,
    add_model_arguments,
    check_model_arguments,
    encode,
    load_model,
    prepare_sentence,
    word_spans,
)

PAPER_SENTENCE = "There is a fire in the mountain ."
PAPER_WORDS = ("fire", "mountain")


def find_word(words: list, wanted: str) -> list[int]:
    """Token positions of the first word equal (ignoring case) to ``wanted``."""
    for word, positions in words:
        if word.casefold() == wanted.casefold():
            return positions
    raise AnalysisError(
        f"word {wanted!r} is not in the prepared sentence " f"({' '.join(w for w, _ in words)})"
    )


def layer_representations(model, src_tokens) -> list[dict]:
    """Per encoder layer: {"dot", "local", "output"} tensors (T x d'), plus the
    module (for its kernel width and dilation). "dot"/"local" are None where the layer
    has no such heads.

    The layer's self-attention input is captured with a forward pre-hook; the two
    representations are then recomputed from it by the attention module's own parts
    (in eval mode this is exactly what its forward computed).
    """
    import torch

    inputs, outputs, handles = {}, {}, []

    def keep_input(i):
        def hook(_module, args, kwargs):
            query = kwargs.get("query", args[0] if args else None)
            inputs[i] = (query, kwargs.get("key_padding_mask"))

        return hook

    def keep_output(i):
        def hook(_module, _args, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output

        return hook

    layers = list(model.encoder.layers)
    try:
        for i, layer in enumerate(layers):
            handles.append(
                layer.self_attn.register_forward_pre_hook(keep_input(i), with_kwargs=True)
            )
            handles.append(layer.register_forward_hook(keep_output(i)))
        with torch.no_grad():
            model.encoder(src_tokens, src_lengths=torch.tensor([src_tokens.size(1)]))
    finally:
        for handle in handles:
            handle.remove()

    result = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            x, padding = inputs[i]
            entry = {"module": attn, "dot": None, "local": None, "output": outputs[i][:, 0]}
            if getattr(attn, "conv_heads", 0):
                heads = attn.head_outputs(x, padding)
                entry["local"] = heads["local"][:, 0]
                if heads["dot"] is not None:
                    entry["dot"] = heads["dot"][:, 0]
            result.append(entry)
    return result


def cosine(rep, first: list[int], second: list[int]) -> float | None:
    import torch.nn.functional as F

    if rep is None:
        return None
    a, b = rep[first].mean(dim=0), rep[second].mean(dim=0)
    return float(F.cosine_similarity(a, b, dim=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpp-embedding-similarity",
        description="Per encoder layer: cosine similarity of two words in the dot-product "
        "heads' output vs the convolution heads' LocalConv representation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (on tpp-demo's model): tpp-embedding-similarity --path "
        "runs/demo/checkpoints/checkpoint_avg.pt --data runs/demo/data-bin/sample_en_de "
        "--bpe-codes runs/demo/work/bpe/codes --words fire mountain",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--sentence",
        default=PAPER_SENTENCE,
        help=f"source sentence (default: the paper's {PAPER_SENTENCE!r})",
    )
    parser.add_argument(
        "--words",
        nargs=2,
        default=list(PAPER_WORDS),
        metavar="WORD",
        help="the two words to compare (default: fire mountain)",
    )
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()  # Ctrl-C, kill: no traceback

    try:
        if args.words[0].casefold() == args.words[1].casefold():
            raise AnalysisError(
                f"--words names {args.words[0]!r} twice: the similarity of a word with "
                "itself is 1 in every layer; give two different words"
            )
        check_model_arguments(args)
        loaded = load_model(args.path, args.data)
        prepared = prepare_sentence(
            args.sentence, loaded.source_lang, args.bpe_codes, args.tokenize
        )
        src_tokens, tokens = encode(loaded, prepared)
        # words from the prepared text, not the dictionary's view of it: a word the
        # model does not know still has a position (and a representation, of <unk>)
        words = word_spans(prepared.split())
        first, second = (find_word(words, w) for w in args.words)
        unknown = loaded.task.source_dictionary.unk_string()
        for word, positions in zip(args.words, (first, second)):
            if all(tokens[p] == unknown for p in positions):
                print(
                    f"warning: {word!r} is out of the model's vocabulary (<unk>)", file=sys.stderr
                )
        layers = layer_representations(loaded.model, src_tokens)
        if not any(entry["local"] is not None for entry in layers):
            raise AnalysisError(
                "the encoder has no convolution-attention heads "
                "(--encoder-conv-heads 0): nothing to compare"
            )
    except AnalysisError as err:
        return report("tpp-embedding-similarity", err)

    def fmt(value):
        return "n/a" if value is None else f"{value:+.4f}"

    print(f"sentence: {' '.join(tokens)}")
    print(f"cosine similarity of {args.words[0]!r} and {args.words[1]!r}")
    header = (
        f"{'layer':>5}  {'F':>3}  {'dil':>3}  {'dot-product heads':>17}  "
        f"{'LocalConv':>9}  {'layer output':>12}"
    )
    print(header)
    print("-" * len(header))
    for i, entry in enumerate(layers, 1):
        conv = getattr(entry["module"], "local_conv", None)
        width = str(conv.kernel_size) if conv is not None else "-"
        dilation = str(conv.dilation) if conv is not None else "-"
        print(
            f"{i:>5}  {width:>3}  {dilation:>3}  "
            f"{fmt(cosine(entry['dot'], first, second)):>17}  "
            f"{fmt(cosine(entry['local'], first, second)):>9}  "
            f"{fmt(cosine(entry['output'], first, second)):>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
