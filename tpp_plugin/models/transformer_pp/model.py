"""Transformer++ (Thapak & Hore, 2020) on top of fairseq's transformer.

Two changes to the post-norm encoder-decoder Transformer, both made through fairseq's
hooks rather than by rewriting layers:

1. every *self*-attention sub-layer (encoder and decoder) is a
   :class:`~tpp_plugin.modules.HybridMultiheadAttention`: ``H - H_c`` scaled
   dot-product heads and ``H_c`` convolution-attention heads, with a LocalConv kernel
   width and dilation chosen per layer; ``H_c = 0`` gives fairseq's own attention back;
2. the first encoder layers are "base encoders" with token classifiers on top: by
   default a part-of-speech head after layer 1 and a named-entity head after layer 2
   (:class:`~tpp_plugin.modules.TagHeads`). They are trained jointly with translation
   (criterion ``label_smoothed_cross_entropy_with_tags``) and computed only when the
   criterion asks, so generation needs nothing but the source text.
"""

import argparse
import contextlib
import copy
import logging
from typing import Dict, List, Optional

from fairseq.models import register_model
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.modules import LayerDropModuleList
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor, nn

from tpp_pipeline.errors import OptionError

from ...modules import TagHeads
from ...modules.hybrid_attention import fuse_legacy_projections
from ...options import format_named, parse_named
from . import config
from .config import ConvHeadsConfig, tag_layers_of
from .layers import TransformerPPDecoderLayer, TransformerPPEncoderLayer, wrap_layer

logger = logging.getLogger(__name__)


class LayerCounter:
    """The index of the layer a stack builds next. fairseq's ``__init__`` builds a
    stack's layers in order, ``0 .. L-1``, through a hook that is not told the index,
    while ours differ per layer (kernel width, dilation). Building them inside fairseq's
    ``__init__``, where it builds them, keeps its order of random draws: the plugin's
    model with 0 conv heads is then initialised weight for weight as fairseq's
    ``transformer`` with the same seed (tested), which is what makes the quality
    study's control (b) identical to its baseline (a)."""

    def __init__(self, stack: str):
        self.stack = stack
        self.built = 0

    def next(self, num_layers: int) -> int:
        if self.built >= num_layers:
            raise RuntimeError(f"the {self.stack} has built its {num_layers} layers already")
        self.built += 1
        return self.built - 1


class RecordedLayerDrop(LayerDropModuleList):
    """fairseq's LayerDrop (its own random draws) remembering the layers its last pass
    ran, in ``ran``: fairseq's encoder returns the states of those layers only, and a
    tag head reads the output of its layer, a skipped layer passing its input on."""

    def __init__(self, p: float, modules):
        super().__init__(p, modules)
        self.ran: List[int] = list(range(len(self)))

    def __iter__(self):
        index = {id(m): i for i, m in enumerate(nn.ModuleList.__iter__(self))}
        self.ran = []
        for m in super().__iter__():
            self.ran.append(index[id(m)])
            yield m


class TransformerPPEncoder(TransformerEncoderBase):
    """Transformer encoder with hybrid self-attention and token-tagging heads on the
    base encoder layers."""

    def __init__(
        self, cfg, dictionary, embed_tokens, tag_classes: Dict[str, int], tag_layers: Dict[str, int]
    ):
        self.conv = ConvHeadsConfig(cfg, "encoder")
        self.layer_counter = LayerCounter("encoder")
        super().__init__(cfg, dictionary, embed_tokens)
        if isinstance(self.layers, LayerDropModuleList):  # --encoder-layerdrop
            layers = list(nn.ModuleList.__iter__(self.layers))  # all, no draws
            self.layers = RecordedLayerDrop(self.layers.p, layers)
        self.tag_heads = TagHeads(cfg.encoder.embed_dim, tag_classes, tag_layers)

    def build_encoder_layer(self, cfg):
        layer_idx = self.layer_counter.next(cfg.encoder.layers)  # fairseq's __init__, in order
        layer = TransformerPPEncoderLayer(cfg, layer_idx, self.conv, return_fc=self.return_fc)
        return wrap_layer(layer, cfg)

    def tag_logits(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, Tensor]:
        """Per-token tag scores (``B x T x classes`` per tag kind) from the hidden states
        the encoder returned (it must have run with ``return_all_hiddens=True``)."""
        return self.tag_heads(encoder_out["encoder_states"], getattr(self.layers, "ran", None))


class TransformerPPDecoder(TransformerDecoderBase):
    """Transformer decoder with hybrid (causal) self-attention."""

    def __init__(
        self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None
    ):
        if getattr(cfg, "base_layers", 0):
            raise OptionError("--base-layers is not supported by transformer_pp")
        self.conv = ConvHeadsConfig(cfg, "decoder")
        if getattr(cfg, "cross_self_attention", False) and self.conv.conv_heads > 0:
            raise OptionError(
                "--cross-self-attention is not supported with convolution heads in the "
                "decoder's self-attention (--decoder-conv-heads 0 allows it)"
            )
        self.layer_counter = LayerCounter("decoder")
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer_idx = self.layer_counter.next(cfg.decoder.layers)  # fairseq's __init__, in order
        layer = TransformerPPDecoderLayer(
            cfg, layer_idx, self.conv, no_encoder_attn=no_encoder_attn
        )
        return wrap_layer(layer, cfg)

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out,
        incremental_state=None,
        full_context_alignment: bool = False,
        alignment_layer=None,
        alignment_heads=None,
    ):
        """fairseq's, refusing ``full_context_alignment`` (no future mask, as
        ``transformer_align``'s alignment pass asks) where the conv heads are causal
        whatever the mask."""
        if full_context_alignment and self.conv.conv_heads > 0:
            raise OptionError(
                "full-context alignment (every target position attending to every other, "
                "as transformer_align asks) is not supported with convolution heads in the "
                "decoder's self-attention (--decoder-conv-heads 0 allows it)"
            )
        return super().extract_features_scriptable(
            prev_output_tokens,
            encoder_out,
            incremental_state,
            full_context_alignment,
            alignment_layer,
            alignment_heads,
        )

    def buffered_future_mask(self, tensor):
        """No future mask for hybrid self-attention: it is causal by construction and
        runs the fused causal kernel (an explicit ``T x T`` mask would rule that out).
        fairseq's own attention (``--decoder-conv-heads 0``) still gets the mask."""
        if self.conv.conv_heads > 0:
            return None
        return super().buffered_future_mask(tensor)


@register_model("transformer_pp")
class TransformerPPModel(TransformerModel):
    """Transformer++: hybrid dot-product/convolution attention heads and POS/NER
    multi-task base encoders. Presets: :mod:`tpp_plugin.models.transformer_pp.presets`."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        config.add_args(parser)

    @classmethod
    def hub_models(cls):
        """No published checkpoints: ``from_pretrained`` takes a folder (fairseq's
        transformer's names would load fairseq's own models)."""
        return {}

    @classmethod
    def build_model(cls, args, task):
        with open_dict(args) if isinstance(args, DictConfig) else contextlib.nullcontext():
            tag_layers = cls.check_args(args)
            classes = cls.resolve_tag_classes(args, task, tag_layers)
            args.encoder_tag_classes = format_named(classes)
            # the side this task pads targets on (the decoder's attention is built for
            # it), whatever the configuration a checkpoint was saved with says
            task_cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
            args.left_pad_target = bool(getattr(task_cfg, "left_pad_target", False))
        if isinstance(args, DictConfig):
            # fairseq-hydra-train's model configuration (and a checkpoint it saved) as
            # fairseq-train's: fairseq's TransformerConfig.from_namespace keeps every
            # option of a Namespace, but only its own fields of a DictConfig
            args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
        return super().build_model(args, task)

    @staticmethod
    def check_args(args) -> Dict[str, int]:
        """Raise :class:`OptionError` naming the option where ``args`` cannot build a
        model (before anything is built: errors name the option, not a shape); returns
        the tag heads' layers."""
        from .presets import transformer_pp_base_architecture

        transformer_pp_base_architecture(args)
        for side in ("encoder", "decoder"):
            keep, depth = config.kept_layers(args, side), getattr(args, f"{side}_layers")
            if keep and keep[-1] >= depth:  # (the whole depth: fairseq has not pruned yet)
                raise OptionError(
                    f"--{side}-layers-to-keep keeps layer {keep[-1]} (0-based), but the "
                    f"{side} has {depth} layers (--{side}-layers)"
                )
            ConvHeadsConfig(args, side)
        return tag_layers_of(args)

    @staticmethod
    def resolve_tag_classes(args, task, tag_layers: Dict[str, int]) -> Dict[str, int]:
        """Number of classes of each tag head. A model rebuilt from a checkpoint (its
        arguments hold ``encoder_tag_classes``) gets the heads saved with it, so that its
        state loads whatever tags the task reads (``--task translation`` has none); a new
        model gets one head per tag dictionary of the task."""
        task_dicts = getattr(task, "tag_dictionaries", None) or {}
        saved = getattr(args, "encoder_tag_classes", None)
        if saved is not None:
            saved = parse_named(saved, "encoder-tag-classes")
            classes = {name: saved[name] for name in tag_layers if name in saved}
            for name, count in classes.items():
                if name in task_dicts and len(task_dicts[name]) != count:
                    raise OptionError(
                        f"the checkpoint's '{name}' head predicts {count} classes, but the "
                        f"task's '{name}' dictionary has {len(task_dicts[name])}: the labels "
                        f"of this data folder are not the ones it was trained on (translate "
                        f"with --task translation, or pass --model-overrides "
                        f"\"{{'encoder_tag_layers': ''}}\")"
                    )
            return classes
        classes = {}
        for name in tag_layers:
            if name in task_dicts:
                classes[name] = len(task_dicts[name])
            elif task_dicts:  # (a misspelt name built no head: said, not silent)
                logger.warning(
                    f"--encoder-tag-layers: no '{name}' head is built, the task loads no "
                    f"'{name}' labels (--tags {','.join(task_dicts)})"
                )
        return classes

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        tag_layers = tag_layers_of(args)
        tag_classes = parse_named(getattr(args, "encoder_tag_classes", ""), "encoder-tag-classes")
        return TransformerPPEncoder(
            TransformerConfig.from_namespace(args),
            src_dict,
            embed_tokens,
            tag_classes={k: v for k, v in tag_classes.items() if k in tag_layers},
            tag_layers=tag_layers,
        )

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return TransformerPPDecoder(
            TransformerConfig.from_namespace(args),
            tgt_dict,
            embed_tokens,
            no_encoder_attn=getattr(args, "no_cross_attention", False),
        )

    def forward(
        self,
        src_tokens,
        src_lengths,
        prev_output_tokens,
        return_all_hiddens: bool = True,
        features_only: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        return_tag_logits: bool = False,
    ):
        """fairseq's encoder-decoder forward; with ``return_tag_logits`` the decoder's
        extra output also holds ``"tag_logits"``: ``{tag: B x T_src x classes}``."""
        encoder_out = self.encoder(
            src_tokens,
            src_lengths=src_lengths,
            return_all_hiddens=return_all_hiddens or return_tag_logits,
        )
        decoder_out = self.decoder(
            prev_output_tokens,
            encoder_out=encoder_out,
            features_only=features_only,
            alignment_layer=alignment_layer,
            alignment_heads=alignment_heads,
            src_lengths=src_lengths,
            return_all_hiddens=return_all_hiddens,
        )
        if return_tag_logits:
            decoder_out[1]["tag_logits"] = self.encoder.tag_logits(encoder_out)
        return decoder_out

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """fairseq's, but ``--*-layers-to-keep`` given for one side keeps every layer of
        the other: fairseq's pruning drops each numbered layer of a side it was not
        given a list for (the state dict then misses all of that side's layers)."""
        cfg = model_cfg if model_cfg is not None else args
        sides = [s for s in ("encoder", "decoder") if getattr(cfg, f"{s}_layers_to_keep", None)]
        if len(sides) == 1:
            other = "decoder" if sides == ["encoder"] else "encoder"
            found = {int(k.split(".")[2]) for k in state_dict if k.startswith(f"{other}.layers.")}
            cfg = copy.deepcopy(cfg)
            with open_dict(cfg) if isinstance(cfg, DictConfig) else contextlib.nullcontext():
                setattr(cfg, f"{other}_layers_to_keep", ",".join(map(str, sorted(found))))
            model_cfg, args = (cfg, None) if model_cfg is not None else (None, cfg)
        return super().load_state_dict(state_dict, strict, model_cfg=model_cfg, args=args)

    def upgrade_state_dict_named(self, state_dict, name):
        # The hybrid attentions of a checkpoint before 0.2, by the state dict's own layer
        # numbers: fairseq prunes (--*-layers-to-keep) after upgrading, and its modules
        # below are numbered as pruned.
        legacy = ".self_attn.local_conv.pointwise.weight"
        for key in [k for k in state_dict if k.startswith(name) and k.endswith(legacy)]:
            fuse_legacy_projections(state_dict, key[: -len(legacy)] + ".self_attn.")
        super().upgrade_state_dict_named(state_dict, name)
        # The tag heads are training-only: a checkpoint with heads the model is built
        # without (--encoder-tag-layers) loads without them, and one without heads the
        # model has (--finetune-from-model into a run with tags) leaves them as built.
        heads = f"{name}.encoder.tag_heads.heads." if name else "encoder.tag_heads.heads."
        for key in [k for k in state_dict if k.startswith(heads)]:
            if key[len(heads) :].split(".")[0] not in self.encoder.tag_heads.heads:
                del state_dict[key]
        for kind, head in self.encoder.tag_heads.heads.items():
            built = {heads + f"{kind}.{k}": v for k, v in head.state_dict().items()}
            if not any(key in state_dict for key in built):
                logger.info(f"no weights for the {kind} tag head: it starts as initialised")
                state_dict.update({key: value.clone() for key, value in built.items()})
