"""fairseq's encoder and decoder layers with the hybrid self-attention of their index,
through fairseq's own hook (``build_self_attention``): nothing else of the layer changes."""

from fairseq.distributed import fsdp_wrap
from fairseq.modules import transformer_layer
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from .config import ConvHeadsConfig


class TransformerPPEncoderLayer(transformer_layer.TransformerEncoderLayerBase):
    """fairseq's encoder layer; its self-attention is layer ``layer_idx``'s hybrid one
    (fairseq's own with ``--encoder-conv-heads 0``)."""

    def __init__(self, cfg, layer_idx: int, conv: ConvHeadsConfig, return_fc=False):
        # build_self_attention runs inside the base __init__: set what it needs first
        self.layer_idx = layer_idx
        self.conv = conv
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        if self.conv.conv_heads == 0:
            return super().build_self_attention(embed_dim, cfg)
        return hybrid_self_attention(self, cfg, causal=False)


class TransformerPPDecoderLayer(transformer_layer.TransformerDecoderLayerBase):
    """fairseq's decoder layer; its self-attention is layer ``layer_idx``'s causal
    hybrid one (fairseq's own with ``--decoder-conv-heads 0``)."""

    def __init__(self, cfg, layer_idx: int, conv: ConvHeadsConfig, no_encoder_attn=False):
        self.layer_idx = layer_idx
        self.conv = conv
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if self.conv.conv_heads == 0:
            return super().build_self_attention(
                embed_dim, cfg, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn
            )
        return hybrid_self_attention(self, cfg, causal=True)


def hybrid_self_attention(layer, cfg, causal: bool):
    """``layer``'s hybrid self-attention, with the attention dropout and quantization
    noise (read by fairseq's ``__init__`` before it builds the attention) that fairseq
    gives its own."""
    return layer.conv.attention(
        layer.layer_idx,
        cfg.attention_dropout,
        causal=causal,
        q_noise=layer.quant_noise,
        qn_block_size=layer.quant_noise_block_size,
    )


def wrap_layer(layer, cfg):
    """What fairseq's ``build_*_layer`` does around a layer: activation checkpointing
    and FSDP wrapping."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not checkpoint else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)
