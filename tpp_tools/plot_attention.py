"""Draw a trained model's attention maps for one sentence, one PNG per layer and kind.

    # a sentence already BPE-segmented as the training data was
    tpp-plot-attention --path runs/demo/checkpoints/checkpoint_avg.pt \\
        --data runs/demo/data-bin/sample_en_de --sentence "There is a fire in the mountain ."

    # raw text: Moses-tokenise and BPE-segment it as the training data was
    tpp-plot-attention --path checkpoints/en-de/checkpoint_avg10.pt --data data-bin/wmt14_en_de \\
        --bpe-codes work/wmt14_en_de/bpe/codes --sentence "There is a fire in the mountain."

The model first translates the sentence (beam search, as fairseq-generate does). Then
source and translation go through one teacher-forced forward pass in eval mode, during
which every attention module is asked for its per-head maps (``need_head_weights``):

* ``encoder_self_layer<N>.png``  encoder self-attention (rows and columns: source tokens)
* ``decoder_self_layer<N>.png``  decoder self-attention (rows: the token each position
  predicts; columns: the decoder's input tokens, starting with ``</s>``)
* ``decoder_cross_layer<N>.png`` encoder-decoder attention (rows: predicted tokens;
  columns: source tokens)

Each PNG is a grid of heatmaps, one per head (4 per row). In Transformer++
self-attention the first heads are scaled dot-product heads (softmax(QK^T/sqrt(d_h)));
the remaining convolution heads show their word-context weights: the softmax over
positions with which the context Query pools the sentence (encoder: every row is the
same sentence summary; decoder: a causal prefix summary per row).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

try:
    import matplotlib
except ImportError:  # (an extra of the package)
    raise SystemExit(
        "tpp-plot-attention: error: needs matplotlib, which is not installed: pip install 'tpp-plugin[plots]'"
    ) from None

matplotlib.use("Agg")  # no display on cluster nodes; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from tpp_pipeline.lock import exit_cleanly_on_sigterm
from tpp_pipeline.errors import report
from tpp_pipeline.pipeline import positive_int

from .analysis_model import (
    AnalysisError,
    add_model_arguments,
    check_model_arguments,
    encode,
    load_model,
    prepare_sentence,
)
from .evaluate import staged_files, writable_folder

CELL_INCHES = 4  # each head's heatmap gets a 4 x 4 inch cell ...
DPI = 100  # ... i.e. 400 x 400 pixels: a PNG is (400 * columns) x (400 * rows)
MAX_COLUMNS = 4


def grid_shape(num_heads: int) -> tuple[int, int]:
    """(rows, columns) of the head grid."""
    cols = min(MAX_COLUMNS, num_heads)
    return math.ceil(num_heads / cols), cols


def head_kinds(module) -> list[str]:
    """Per head: "dot-product" or "conv word-context" (fairseq's own attention: all dot)."""
    heads = module.num_heads
    conv = getattr(module, "conv_heads", 0)
    return ["dot-product"] * (heads - conv) + ["conv word-context"] * conv


def attention_modules(model) -> list[tuple[str, int, object]]:
    """(kind, 1-based layer, module) for every attention module of the model."""
    found = []
    for i, layer in enumerate(model.encoder.layers, 1):
        found.append(("encoder_self", i, layer.self_attn))
    for i, layer in enumerate(model.decoder.layers, 1):
        found.append(("decoder_self", i, layer.self_attn))
        if getattr(layer, "encoder_attn", None) is not None:
            found.append(("decoder_cross", i, layer.encoder_attn))
    return found


def capture_maps(model, src_tokens, prev_output_tokens) -> dict:
    """Run one forward pass and return {(kind, layer): H x T x S maps} of sentence 0.

    The layers call their attention modules with ``need_weights=False``; a forward
    pre-hook turns per-head weights on (the layers discard the extra output, apart
    from fairseq's alignment layer, which averages it) and a forward hook keeps them.
    fairseq's own attention answers self-attention through PyTorch's, which averages
    the heads: its ``skip_embed_dim_check`` sends it down its own path meanwhile.
    """
    import torch

    captured = {}
    handles = []
    own_path = [m for _, _, m in attention_modules(model) if hasattr(m, "skip_embed_dim_check")]
    saved = [m.skip_embed_dim_check for m in own_path]

    def ask_for_weights(_module, args, kwargs):
        kwargs["need_weights"] = True
        kwargs["need_head_weights"] = True
        return args, kwargs

    def keeper(key):
        def keep(_module, _args, _kwargs, output):
            weights = output[1]
            if weights is None or weights.dim() != 4:
                raise RuntimeError(f"{key[0]} layer {key[1]} returned no per-head weights")
            captured[key] = weights[:, 0].detach().float().cpu()  # H x T x S

        return keep

    try:
        for module in own_path:
            module.skip_embed_dim_check = True
        for kind, layer, module in attention_modules(model):
            handles.append(module.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
            handles.append(module.register_forward_hook(keeper((kind, layer)), with_kwargs=True))
        with torch.no_grad():
            model(src_tokens, torch.tensor([src_tokens.size(1)]), prev_output_tokens)
    finally:
        for handle in handles:
            handle.remove()
        for module, value in zip(own_path, saved):
            module.skip_embed_dim_check = value
    return captured


def translate(loaded, src_tokens, beam: int):
    """The model's own best translation (token ids, EOS last), with fairseq's generator."""
    import torch
    from fairseq.dataclass.configs import GenerationConfig

    generator = loaded.task.build_generator([loaded.model], GenerationConfig(beam=beam))
    sample = {
        "net_input": {"src_tokens": src_tokens, "src_lengths": torch.tensor([src_tokens.size(1)])}
    }
    with torch.no_grad():
        hypos = generator.generate([loaded.model], sample)
    return hypos[0][0]["tokens"].cpu()


def draw_grid(
    maps, kinds: list[str], rows_labels: list[str], col_labels: list[str], title: str, out: Path
) -> None:
    """One heatmap per head, token labels on both axes."""
    n_rows, n_cols = grid_shape(maps.size(0))
    fig, axes = plt.subplots(
        n_rows, n_cols, squeeze=False, dpi=DPI, figsize=(CELL_INCHES * n_cols, CELL_INCHES * n_rows)
    )
    # smaller labels for longer sentences, so they stay legible without overlapping
    size = max(3.0, min(8.0, 200.0 / max(len(rows_labels), len(col_labels))))
    for h, ax in enumerate(axes.flat):
        if h >= maps.size(0):
            ax.axis("off")
            continue
        head = maps[h].numpy()
        # each head on its own scale: conv heads' pooling weights are much flatter
        ax.imshow(
            head,
            cmap="viridis",
            vmin=0.0,
            vmax=max(float(head.max()), 1e-9),
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(f"head {h + 1}: {kinds[h]}", fontsize=9)
        ax.set_xticks(range(len(col_labels)))
        ax.set_xticklabels(col_labels, rotation=90, fontsize=size)
        ax.set_yticks(range(len(rows_labels)))
        ax.set_yticklabels(rows_labels, fontsize=size)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    # no bbox_inches="tight": the pixel size must follow from the head count alone
    fig.savefig(out, dpi=DPI, format="png")
    plt.close(fig)


TITLES = {
    "encoder_self": "Encoder self-attention",
    "decoder_self": "Decoder self-attention",
    "decoder_cross": "Encoder-decoder attention",
}


def layer_note(module) -> str:
    conv = getattr(module, "local_conv", None)
    if conv is None:
        return ""
    return f" (LocalConv F={conv.kernel_size}, dilation {conv.dilation})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpp-plot-attention",
        description="Plot per-head attention maps of a trained (Transformer++) model for "
        "one source sentence: one PNG per layer and attention kind.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (on tpp-demo's model): tpp-plot-attention --path "
        "runs/demo/checkpoints/checkpoint_avg.pt --data runs/demo/data-bin/sample_en_de "
        "--bpe-codes runs/demo/work/bpe/codes --sentence 'There is a fire in the mountain.'",
    )
    add_model_arguments(parser)
    parser.add_argument("--sentence", required=True, help="source sentence")
    parser.add_argument(
        "--target", default=None, help="use this (prepared) translation instead of the model's own"
    )
    parser.add_argument("--beam", type=positive_int, default=5, help="beam size (default: 5)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("attention"),
        help="folder for the PNGs (default: ./attention)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing PNGs")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()  # Ctrl-C, kill: the maps staged so far removed, no traceback

    try:
        if not args.sentence.strip():  # before the (slow) model loading
            raise AnalysisError("the sentence is empty")
        check_model_arguments(args)
        if args.out_dir.exists() and not args.out_dir.is_dir():
            raise AnalysisError(f"{args.out_dir}: not a folder (--out-dir)")
        loaded = load_model(args.path, args.data)
        prepared = prepare_sentence(
            args.sentence, loaded.source_lang, args.bpe_codes, args.tokenize
        )
        src_tokens, src_labels = encode(loaded, prepared)
        import torch

        tgt_dict = loaded.task.target_dictionary
        hypothesis = _hypothesis(loaded, src_tokens, args.target, args.beam)
        out_labels = [tgt_dict[i] for i in hypothesis.tolist()]
        # decoder input: EOS first, then the translation shifted right (fairseq's layout)
        prev = torch.cat([hypothesis.new_tensor([tgt_dict.eos()]), hypothesis[:-1]])
        in_labels = [tgt_dict[i] for i in prev.tolist()]

        modules = attention_modules(loaded.model)
        targets = {
            (kind, layer): args.out_dir / f"{kind}_layer{layer}.png" for kind, layer, _ in modules
        }
        existing = [p for p in targets.values() if p.exists()]
        if existing and not args.force:
            raise AnalysisError(f"{existing[0]} exists; pass --force to overwrite")

        maps = capture_maps(loaded.model, src_tokens, prev.unsqueeze(0))
        writable_folder(args.out_dir, "--out-dir folder", AnalysisError)
    except AnalysisError as err:
        return report("tpp-plot-attention", err)

    print(f"source:      {' '.join(src_labels)}")
    print(f"translation: {' '.join(out_labels)}")
    labels = {
        "encoder_self": (src_labels, src_labels),
        "decoder_self": (out_labels, in_labels),
        "decoder_cross": (out_labels, src_labels),
    }
    with staged_files(args.out_dir) as staging:  # (a failed run leaves the earlier maps whole)
        for kind, layer, module in modules:
            rows, cols = labels[kind]
            title = f"{TITLES[kind]}, layer {layer}{layer_note(module)}"
            staged = staging / targets[kind, layer].name
            draw_grid(maps[kind, layer], head_kinds(module), rows, cols, title, staged)
    for target in targets.values():
        print(f"wrote {target}")
    if args.force:  # the maps of layers this model lacks are an earlier model's
        _remove_other_maps(args.out_dir, set(targets.values()))
    return 0


def _hypothesis(loaded, src_tokens, target: str | None, beam: int):
    """The translation whose maps are drawn: ``target`` (prepared text) encoded, or the
    model's own with beam ``beam``; token ids, end of sentence included."""
    if target is None:
        return translate(loaded, src_tokens, beam)
    if not target.strip():
        raise AnalysisError("--target is empty")
    tgt_dict = loaded.task.target_dictionary
    hypothesis = tgt_dict.encode_line(target, add_if_not_exist=False, append_eos=True).long()
    if all(i in (tgt_dict.unk(), tgt_dict.eos()) for i in hypothesis.tolist()):
        raise AnalysisError(
            f"no token of --target {target!r} is in the target dictionary: is it "
            "tokenised/BPE-segmented like the training data?"
        )
    if len(hypothesis) > loaded.model.decoder.max_positions():
        raise AnalysisError(
            f"--target is {len(hypothesis)} subwords long with its end of sentence, "
            f"and the model reads at most {loaded.model.decoder.max_positions()}"
        )
    return hypothesis


def _remove_other_maps(out_dir: Path, written: set) -> None:
    """Remove the maps in ``out_dir`` (``KIND_layerN.png``) that this run did not write."""
    for kind in TITLES:
        named = {
            p
            for p in out_dir.glob(f"{kind}_layer*.png")
            if p.stem[len(kind) + 6 :].isdigit()  # KIND_layerN.png
        }
        for stale in named - written:
            stale.unlink()


if __name__ == "__main__":
    sys.exit(main())
