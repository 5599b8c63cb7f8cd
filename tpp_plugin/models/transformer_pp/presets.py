"""The ``--arch`` presets of ``transformer_pp``, as one chain: every preset sets its own
values and hands the rest to :func:`transformer_pp_base_architecture`, which fills in
fairseq's transformer defaults and the paper's (an option given on the command line
always wins: presets only fill what is unset)."""

from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture as transformer_base_architecture

from .config import default_dilations, default_kernel_sizes


def _default(args, name, value):
    setattr(args, name, getattr(args, name, value))


@register_model_architecture("transformer_pp", "transformer_pp")
def transformer_pp_base_architecture(args):
    """Base size: d=512, 8 heads (4 dot-product + 4 convolution), FFN 2048, 5+5 layers."""
    _default(args, "encoder_layers", 5)
    _default(args, "decoder_layers", 5)
    _default(args, "dropout", 0.1)
    _default(args, "attention_dropout", 0.1)
    _default(args, "activation_dropout", 0.1)
    transformer_base_architecture(args)
    _default(args, "encoder_conv_heads", args.encoder_attention_heads // 2)
    _default(args, "decoder_conv_heads", args.decoder_attention_heads // 2)
    _default(args, "encoder_conv_kernel_sizes", default_kernel_sizes(args.encoder_layers))
    _default(args, "decoder_conv_kernel_sizes", default_kernel_sizes(args.decoder_layers))
    _default(
        args,
        "encoder_conv_dilations",
        default_dilations(args.encoder_conv_kernel_sizes, "encoder-conv-kernel-sizes"),
    )
    _default(
        args,
        "decoder_conv_dilations",
        default_dilations(args.decoder_conv_kernel_sizes, "decoder-conv-kernel-sizes"),
    )
    _default(args, "conv_weight_dropout", 0.1)
    _default(args, "encoder_conv_centered", False)
    _default(args, "conv_head_scaling", "none")
    _default(args, "conv_query_temperature", 1.0)
    _default(args, "conv_heads_impl", "auto")
    _default(args, "encoder_tag_layers", "pos:1,ner:2")


@register_model_architecture("transformer_pp", "transformer_pp_tiny")
def transformer_pp_tiny(args):
    """For tests: d=64, 4 heads (2+2), FFN 128, 2+2 layers."""
    _default(args, "encoder_embed_dim", 64)
    _default(args, "encoder_ffn_embed_dim", 128)
    _default(args, "encoder_layers", 2)
    _default(args, "encoder_attention_heads", 4)
    _default(args, "decoder_layers", 2)
    _default(args, "decoder_attention_heads", 4)
    _default(args, "dropout", 0.1)
    _default(args, "attention_dropout", 0.0)
    _default(args, "activation_dropout", 0.0)
    _default(args, "conv_weight_dropout", 0.0)
    transformer_pp_base_architecture(args)


@register_model_architecture("transformer_pp", "transformer_pp_cpu")
def transformer_pp_cpu(args):
    """The CPU demo's model (the CPU study's sizes), chosen for learning speed on a few
    cores: d=256, 4 heads (2+2), FFN 512, 3+3 layers, kernels 3,5,7 with dilations
    1,1,2, dropout 0.1 (no attention/activation dropout, no DropConnect), all
    embeddings shared (one joint dictionary), and the conv heads' output scaled by
    1/sqrt(d_h) (``--conv-head-scaling inv-sqrt-head-dim``: the paper's unscaled
    heads learned far more slowly at this size in the CPU study, docs/results_cpu.md)."""
    _default(args, "encoder_embed_dim", 256)
    _default(args, "encoder_ffn_embed_dim", 512)
    _default(args, "encoder_layers", 3)
    _default(args, "encoder_attention_heads", 4)
    _default(args, "decoder_layers", 3)
    _default(args, "decoder_attention_heads", 4)
    _default(args, "dropout", 0.1)
    _default(args, "attention_dropout", 0.0)
    _default(args, "activation_dropout", 0.0)
    _default(args, "conv_weight_dropout", 0.0)
    _default(args, "share_all_embeddings", True)
    _default(args, "conv_head_scaling", "inv-sqrt-head-dim")
    transformer_pp_base_architecture(args)


@register_model_architecture("transformer_pp", "transformer_pp_iwslt_de_en")
def transformer_pp_iwslt_de_en(args):
    """For small corpora (IWSLT-sized): d=512, 4 heads (2+2), FFN 1024, 5+5 layers,
    dropout 0.3 as fairseq's transformer_iwslt_de_en."""
    _default(args, "encoder_embed_dim", 512)
    _default(args, "encoder_ffn_embed_dim", 1024)
    _default(args, "encoder_attention_heads", 4)
    _default(args, "decoder_attention_heads", 4)
    _default(args, "dropout", 0.3)
    transformer_pp_base_architecture(args)


@register_model_architecture("transformer_pp", "transformer_pp_wmt_en_de_big")
def transformer_pp_wmt_en_de_big(args):
    """The paper's WMT'14 En-De model: d=1024, 16 heads (8+8), FFN 4096, 5+5 layers.

    Dropout mapping: the paper's "dropout 0.25" is on attention weights and FFN
    activations; its residual and token-embedding dropout 0.1 is fairseq's --dropout.
    Embeddings: source and target tables are separate (over one joint dictionary) and
    the decoder's input and output embeddings are tied: with the 32,768-type joint
    dictionary of our WMT'14 pipeline this gives 209.0M parameters (paper: 212M)."""
    _default(args, "encoder_embed_dim", 1024)
    _default(args, "encoder_ffn_embed_dim", 4096)
    _default(args, "encoder_attention_heads", 16)
    _default(args, "decoder_attention_heads", 16)
    _default(args, "dropout", 0.1)
    _default(args, "attention_dropout", 0.25)
    _default(args, "activation_dropout", 0.25)
    _default(args, "share_decoder_input_output_embed", True)
    transformer_pp_base_architecture(args)


@register_model_architecture("transformer_pp", "transformer_pp_wmt_en_fr_big")
def transformer_pp_wmt_en_fr_big(args):
    """The paper's WMT'14 En-Fr model: as En-De with 0.15 attention/activation dropout."""
    _default(args, "attention_dropout", 0.15)
    _default(args, "activation_dropout", 0.15)
    transformer_pp_wmt_en_de_big(args)
