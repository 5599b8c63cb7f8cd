"""The options of ``transformer_pp`` (besides fairseq's transformer options), their
parsing and validation.

Per-layer settings are comma-separated lists, one value per layer
(``--encoder-conv-kernel-sizes 3,5,7,11,15``); tag heads are ``name:layer`` pairs
(``--encoder-tag-layers pos:1,ner:2``). Both are read by the parsers below, whose
errors name the option.
"""

import argparse
from typing import Dict, List, Optional

from tpp_pipeline.errors import OptionError

from ...modules import HybridMultiheadAttention
from ...modules.hybrid_attention import OUTPUT_SCALINGS
from ...modules.conv_heads_triton import IMPLS as CONV_HEADS_IMPLS
from ...options import format_named, parse_int_list, parse_named, tag_layers

#: the paper's kernel widths for blocks 1..5 (encoder and decoder alike)
PAPER_KERNEL_SIZES = (3, 5, 7, 11, 15)


def default_kernel_sizes(num_layers: int) -> str:
    """The paper's widths, cut to ``num_layers`` (or continued with the widest)."""
    widths = list(PAPER_KERNEL_SIZES[:num_layers])
    widths += [PAPER_KERNEL_SIZES[-1]] * (num_layers - len(widths))
    return ",".join(map(str, widths))


def default_dilations(kernel_sizes: str, option: str) -> str:
    """Our default (the paper gives no values): dilation 1 for the narrow kernels
    (F <= 5, where the lower, POS/NER-trained layers look at dense local context) and 2
    for the wide ones, so the five paper layers look back 2, 4, 12, 20 and 28 positions."""
    widths = parse_int_list(kernel_sizes, option)
    return ",".join("1" if f <= 5 else "2" for f in widths)


def _bool(value) -> bool:
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def add_args(parser) -> None:
    """The model options ``transformer_pp`` adds to fairseq's transformer."""
    # fmt: off
    parser.add_argument('--encoder-conv-heads', type=int, metavar='N',
                        help='convolution-attention heads per encoder self-attention '
                             '(the rest are dot-product heads; 0 = plain Transformer; '
                             'default: half the heads)')
    parser.add_argument('--decoder-conv-heads', type=int, metavar='N',
                        help='convolution-attention heads per decoder self-attention '
                             '(default: half the heads)')
    parser.add_argument('--encoder-conv-kernel-sizes', type=str, metavar='F1,F2,...',
                        help='LocalConv kernel width of each encoder layer (default: the '
                             'paper\'s 3,5,7,11,15, the widest repeated for more layers)')
    parser.add_argument('--decoder-conv-kernel-sizes', type=str, metavar='F1,F2,...',
                        help='LocalConv kernel width of each decoder layer (default: the '
                             'paper\'s widths, as for the encoder)')
    parser.add_argument('--encoder-conv-dilations', type=str, metavar='D1,D2,...',
                        help='LocalConv dilation of each encoder layer (default: 1 for '
                             'widths up to 5, 2 for wider ones)')
    parser.add_argument('--decoder-conv-dilations', type=str, metavar='D1,D2,...',
                        help='LocalConv dilation of each decoder layer (default: 1 for '
                             'widths up to 5, 2 for wider ones)')
    parser.add_argument('--encoder-conv-centered', type=_bool, metavar='BOOL',
                        help="centre the encoder's LocalConv window on the current position "
                             "(default False: causal, as the paper describes it)")
    parser.add_argument('--conv-head-scaling', choices=OUTPUT_SCALINGS, metavar='SCALING',
                        help="scale of the conv heads' output LocalConv * Query: 'none' (the paper, "
                             "default) or 'inv-sqrt-head-dim' (times 1/sqrt(d_h), as the dot-product "
                             "heads' scores; its effect: docs/results_cpu.md)")
    parser.add_argument('--conv-query-temperature', type=float, metavar='T',
                        help="the conv heads' Query pools with softmax(scores / T) (default 1: "
                             "the paper, which has no temperature)")
    parser.add_argument('--conv-weight-dropout', type=float, metavar='P',
                        help='DropConnect probability on the normalised LocalConv kernels '
                             '(default: 0.1)')
    parser.add_argument('--conv-heads-impl', choices=CONV_HEADS_IMPLS, metavar='IMPL',
                        help="how the conv heads run on a GPU: 'triton' (Triton kernels: "
                             "LocalConv in one launch forward and two backward, a decoding step of "
                             "the conv heads in one), 'fused' ('triton', and the conv heads of a "
                             "whole sequence in one launch forward and three backward), 'taps' "
                             "(PyTorch operations, one per LocalConv tap) or 'auto' (default: "
                             "'triton' where Triton is installed); 'taps' on the CPU, and where "
                             "Triton is not installed")
    parser.add_argument('--encoder-tag-layers', type=str, metavar='TAG:LAYER,...',
                        help='token classifiers on the base encoders: tag kind and the '
                             '(1-based) encoder layer it reads (default: "pos:1,ner:2"); '
                             'empty for none')
    # fmt: on


class ConvHeadsConfig:
    """The convolution-attention settings of one stack (``side`` is ``"encoder"`` or
    ``"decoder"``), validated at construction: errors name the option."""

    def __init__(self, args, side: str):
        # ``args`` is fairseq's flat namespace or its TransformerConfig, which answers
        # the same flat names (``encoder_layers`` is ``cfg.encoder.layers``)
        prefix = f"{side}_"
        self.side = side
        keep = kept_layers(args, side)
        # fairseq builds as many layers as are kept (and so does it with ``args``' copy)
        self.num_layers = len(keep) if keep else getattr(args, prefix + "layers")
        self.embed_dim = getattr(args, prefix + "embed_dim")
        self.heads = getattr(args, prefix + "attention_heads")
        self.conv_heads = getattr(args, prefix + "conv_heads")
        self.weight_dropout = getattr(args, "conv_weight_dropout", 0.0)
        self.centered = bool(getattr(args, prefix + "conv_centered", False))
        # checkpoints written before the option existed hold none: the paper's product
        self.output_scaling = getattr(args, "conv_head_scaling", None) or "none"
        temperature = getattr(args, "conv_query_temperature", None)  # None: an older checkpoint
        self.query_temperature = 1.0 if temperature is None else float(temperature)
        self.conv_heads_impl = (
            getattr(args, "conv_heads_impl", None) or "auto"
        )  # None: an older checkpoint
        #: the task's (TransformerPPModel.build_model files it in the model's configuration)
        self.right_padded_targets = not getattr(args, "left_pad_target", False)
        opt = f"{side}-conv"
        if self.heads < 1 or self.embed_dim % self.heads != 0:
            raise OptionError(
                f"--{side}-attention-heads ({self.heads}) must divide --{side}-embed-dim ({self.embed_dim})"
            )
        if not 0 <= self.conv_heads <= self.heads:
            raise OptionError(
                f"--{opt}-heads ({self.conv_heads}) must be between 0 and --{side}-attention-heads ({self.heads})"
            )
        self.kernel_sizes = parse_int_list(
            getattr(args, prefix + "conv_kernel_sizes"), f"{opt}-kernel-sizes"
        )
        self.dilations = parse_int_list(
            getattr(args, prefix + "conv_dilations"), f"{opt}-dilations"
        )
        for option, values in (
            (f"{opt}-kernel-sizes", self.kernel_sizes),
            (f"{opt}-dilations", self.dilations),
        ):
            if keep:  # the values of the layers kept, which fairseq renumbers 0, 1, ...
                if len(values) <= keep[-1]:
                    raise OptionError(
                        f"--{side}-layers-to-keep keeps layer {keep[-1]} (0-based), but --{option} "
                        f"gives the {side} {len(values)} layers ({','.join(map(str, values))})"
                    )
                values[:] = [values[i] for i in keep]
            if len(values) != self.num_layers:
                raise OptionError(
                    f"--{option} needs one value per layer: {len(values)} given "
                    f"({','.join(map(str, values))}) for --{side}-layers {self.num_layers}"
                )
            if any(v < 1 for v in values):
                raise OptionError(f"--{option} values must be >= 1, got {values}")
        positions = f"max_{'source' if side == 'encoder' else 'target'}_positions"
        longest = getattr(args, positions, None) or 1024  # (fairseq's default)
        for layer, (width, dilation) in enumerate(zip(self.kernel_sizes, self.dilations), 1):
            if (width - 1) * dilation + 1 > longest:  # no sentence could fill it
                raise OptionError(
                    f"--{opt}-kernel-sizes and --{opt}-dilations: layer {layer}'s window, "
                    f"{width} taps {dilation} apart, spans {(width - 1) * dilation + 1} "
                    f"positions, more than the {longest} the model takes"
                )
        if not self.query_temperature > 0:
            raise OptionError(f"--conv-query-temperature must be > 0, got {self.query_temperature}")
        if not 0.0 <= self.weight_dropout < 1.0:
            raise OptionError(f"--conv-weight-dropout must be in [0, 1), got {self.weight_dropout}")

    def attention(
        self,
        layer_idx: int,
        dropout: float,
        causal: bool,
        q_noise: float = 0.0,
        qn_block_size: int = 8,
    ) -> HybridMultiheadAttention:
        """The hybrid self-attention of layer ``layer_idx`` (0-based), with the layer's
        attention dropout and quantization noise."""
        return HybridMultiheadAttention(
            self.embed_dim,
            self.heads,
            self.conv_heads,
            kernel_size=self.kernel_sizes[layer_idx],
            dilation=self.dilations[layer_idx],
            dropout=dropout,
            conv_weight_dropout=self.weight_dropout,
            causal=causal,
            centered_conv=self.centered and not causal,
            output_scaling=self.output_scaling,
            query_temperature=self.query_temperature,
            conv_heads_impl=self.conv_heads_impl,
            # fairseq pads targets on the right, unless the task says otherwise
            right_padded=causal and self.right_padded_targets,
            q_noise=q_noise,
            qn_block_size=qn_block_size,
        )


def kept_layers(args, side: str) -> Optional[List[int]]:
    """The 0-based layers that fairseq's ``--{side}-layers-to-keep`` keeps, sorted (it
    prunes a model trained with LayerDrop as it loads, e.g. ``fairseq-generate
    --model-overrides "{'encoder_layers_to_keep': '0,2'}"``, numbering the kept layers
    0, 1, ... in this order), or None where it is not set."""
    value = getattr(args, f"{side}_layers_to_keep", None)
    if not value:
        return None
    keep = sorted(parse_int_list(value, f"{side}-layers-to-keep"))
    if keep[0] < 0 or len(set(keep)) < len(keep):
        raise OptionError(f"--{side}-layers-to-keep: distinct 0-based layer numbers, got {value!r}")
    return keep


def tag_layers_of(args) -> Dict[str, int]:
    """``--encoder-tag-layers``, checked against the number of encoder layers; where
    ``--encoder-layers-to-keep`` prunes the encoder, the layers the heads read renumbered
    as fairseq renumbers the kept layers (a head whose layer is pruned is an error). A
    model rebuilt from a checkpoint has only the heads it was saved with."""
    keep = kept_layers(args, "encoder")
    if not keep:
        return tag_layers(args.encoder_tag_layers, args.encoder_layers)
    layers = parse_named(args.encoder_tag_layers, "encoder-tag-layers")
    saved = getattr(args, "encoder_tag_classes", None)
    if saved is not None:
        saved = parse_named(saved, "encoder-tag-classes")
        layers = {name: layer for name, layer in layers.items() if name in saved}
    # ``encoder_layers`` is the whole depth before fairseq builds, the kept one after
    layers = tag_layers(format_named(layers), max(args.encoder_layers, keep[-1] + 1))
    pruned = {name: layer for name, layer in layers.items() if layer - 1 not in keep}
    if pruned:
        raise OptionError(
            f"--encoder-layers-to-keep {','.join(map(str, keep))} (0-based) prunes the encoder "
            f"layers that tag heads read ({format_named(pruned)}, 1-based): keep those layers, "
            f"or build the model without its tag heads (--encoder-tag-layers '', in "
            f"--model-overrides 'encoder_tag_layers': ''), which translation does not use"
        )
    return {name: keep.index(layer - 1) + 1 for name, layer in layers.items()}
