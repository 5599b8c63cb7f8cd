"""Hybrid multi-head self-attention of Transformer++.

With ``H`` heads of width ``d_h = d / H``, the first ``H_a`` heads are ordinary scaled
dot-product self-attention and the last ``H_c = H - H_a`` are *convolution attention*
heads; all head outputs are concatenated and mixed by one output projection:

.. math::

    \\operatorname{MultiHead}(S) &= [\\,\\mathrm{head}_1; \\dots; \\mathrm{head}_H\\,]\\, W^O,
        \\qquad W^O \\in \\mathbb{R}^{d \\times d}

    \\mathrm{head}_i &= \\operatorname{softmax}\\!\\Big(\\frac{(S W_i^Q)(S W_i^K)^\\top}
        {\\sqrt{d_h}} + M\\Big)\\, S W_i^V
        \\qquad (i \\le H_a)

    \\mathrm{head}_i &= \\operatorname{LocalConv}_i(S) \\odot \\operatorname{Query}_i(S)
        \\qquad (i > H_a)

We read the paper's ``DynamicConv(S) = Conv1D(LocalConv, Query)``, "simply computing the
dot product between LocalConv and Query", as a width-one convolution whose kernel is the
Query (a full dot product would give a scalar, not a head of width ``d_h``): the product
above, summed over channels by ``W^O``. The paper gives it no scale (``none``);
``--conv-head-scaling inv-sqrt-head-dim`` multiplies it by ``1/√d_h`` (why: docs/results_cpu.md).

Every input projection is a slice of one ``in_proj`` (``d x (3·H_a·d_h + 2·H_c·d_h +
H_c)``, rounded up to a multiple of 8 rows). A drop-in for fairseq's ``MultiheadAttention``
(``T x B x d``); its incremental state holds ``prev_kv`` (``B x H_a x 2 x t x d_h``) and
``prev_padding`` (``B x t``); :class:`LocalConv` and :class:`ContextQuery` keep their own.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor, nn

from . import conv_heads_triton
from .context_query import ContextQuery
from .local_conv import LocalConv

#: values of ``output_scaling`` (``--conv-head-scaling``): the paper's product, or scaled by 1/sqrt(d_h)
OUTPUT_SCALINGS = ("none", "inv-sqrt-head-dim")
#: ``in_proj``'s width is a multiple of this many elements (see ``projection_sizes``)
ALIGN = 8
#: the slices of ``in_proj``, in order, and the parameters that held them before the
#: projections were fused (for loading older checkpoints)
PROJECTIONS = ("q", "k", "v", "local", "value", "score")
_LEGACY_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "local": "local_conv.pointwise",
    "value": "context_query.value_proj",
    "score": "context_query.score_proj",
}


def fuse_legacy_projections(state_dict, prefix: str) -> None:
    """Fuse the separate input projections that versions before 0.2 saved under
    ``prefix`` (``q_proj``, ..., ``context_query.score_proj``) into ``prefix +
    "in_proj"``: the same rows in the order of :data:`PROJECTIONS`, padded as the module
    pads them. Works from the state dict's names alone, so that a model pruned with
    ``--*-layers-to-keep`` (whose modules are renumbered) is upgraded before pruning."""
    if prefix + "in_proj.weight" in state_dict:
        return
    legacy = [
        prefix + _LEGACY_NAMES[n]
        for n in PROJECTIONS
        if f"{prefix}{_LEGACY_NAMES[n]}.weight" in state_dict
    ]
    if not legacy:
        return  # not a checkpoint of this module: let loading report it
    for part in ("weight", "bias"):
        pieces = [state_dict.pop(f"{old}.{part}") for old in legacy]
        rows = sum(piece.shape[0] for piece in pieces)
        if rows % ALIGN:
            pieces.append(pieces[0].new_zeros(ALIGN - rows % ALIGN, *pieces[0].shape[1:]))
        state_dict[f"{prefix}in_proj.{part}"] = torch.cat(pieces)


def projection_sizes(dot_heads: int, conv_heads: int, head_dim: int) -> List[Tuple[str, int]]:
    """``(name, width)`` of each slice of ``in_proj``'s output, in the order of
    :data:`PROJECTIONS`, without empty ones; then unused rows up to a multiple of
    :data:`ALIGN`, so that the output's rows (and with ``d_h`` a multiple of 8, every slice)
    start on 16-byte boundaries in half precision: the fused attention kernels read q, k
    and v in place and fail on misaligned strides."""
    dot_dim, conv_dim = dot_heads * head_dim, conv_heads * head_dim
    sizes = dict(q=dot_dim, k=dot_dim, v=dot_dim, local=conv_dim, value=conv_dim, score=conv_heads)
    slices = [(name, sizes[name]) for name in PROJECTIONS if sizes[name] > 0]
    total = sum(width for _, width in slices)
    if total % ALIGN:
        slices.append(("pad", ALIGN - total % ALIGN))
    return slices


@with_incremental_state
class HybridMultiheadAttention(nn.Module):
    """``H - H_c`` scaled dot-product heads and ``H_c`` convolution-attention heads.

    Args:
        embed_dim: model width ``d``.
        num_heads: total number of heads ``H``.
        conv_heads: ``H_c``, the number of convolution-attention heads (``1..H``).
        kernel_size: LocalConv width ``F``.
        dilation: LocalConv dilation ``δ``.
        dropout: attention dropout of the dot-product heads.
        conv_weight_dropout: DropConnect on the conv heads' normalised kernels.
        causal: decoder self-attention (causal conv, prefix Query, future masking).
        right_padded: (causal only) the sequences of a parallel forward are padded on
            the right, as fairseq pads targets: the padding mask is then not needed.
        centered_conv: (encoder only) LocalConv sees ``⌊(F-1)/2⌋·δ`` positions ahead
            as well as behind, instead of the paper's causal window.
        output_scaling: ``"none"`` (the paper) or ``"inv-sqrt-head-dim"``: the conv
            heads' output ``LocalConv ⊙ Query`` multiplied by ``1/√d_h``.
        query_temperature: the Query's pooling temperature (1: the paper).
        conv_heads_impl: ``"auto"``, ``"taps"``, ``"triton"`` or ``"fused"``: on CUDA
            tensors, LocalConv's convolution and the conv heads' decoding step as Triton
            kernels (:mod:`~tpp_plugin.modules.conv_heads_triton`; ``"auto"``: where
            Triton is installed); ``"fused"`` also all of the conv heads of a whole-sequence
            forward, in training or not (:mod:`~tpp_plugin.modules.query_triton`);
            ``"taps"`` where Triton is not installed.
        q_noise, qn_block_size: fairseq's quantization noise on the input and output
            projections in training (``--quant-noise-pq``, ``--quant-noise-pq-block-size``),
            as its ``MultiheadAttention`` puts it on its own.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        conv_heads: int,
        kernel_size: int,
        dilation: int = 1,
        dropout: float = 0.0,
        conv_weight_dropout: float = 0.0,
        causal: bool = False,
        right_padded: bool = False,
        centered_conv: bool = False,
        output_scaling: str = "none",
        query_temperature: float = 1.0,
        conv_heads_impl: str = "auto",
        q_noise: float = 0.0,
        qn_block_size: int = 8,
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        if not 0 < conv_heads <= num_heads:
            raise ValueError(f"conv_heads must be in 1..{num_heads}, got {conv_heads}")
        if causal and centered_conv:
            raise ValueError("a causal (decoder) self-attention cannot have a centred LocalConv")
        if output_scaling not in OUTPUT_SCALINGS:
            raise ValueError(
                f"output_scaling must be one of {', '.join(OUTPUT_SCALINGS)}, got {output_scaling!r}"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.output_scaling = output_scaling
        self.conv_heads = conv_heads
        self.dot_heads = num_heads - conv_heads
        self.causal = causal
        self.right_padded = right_padded and causal
        self.scaling = self.head_dim**-0.5
        # fairseq's layers and tools look for these MultiheadAttention attributes
        self.kdim = self.vdim = embed_dim
        self.self_attention = True
        self.encoder_decoder_attention = False

        conv_dim = conv_heads * self.head_dim
        #: (name, width) of each slice of in_proj's output, in order (no empty slices)
        self.projection_sizes = projection_sizes(self.dot_heads, conv_heads, self.head_dim)
        self._names = [n for n, _ in self.projection_sizes]
        self._widths = [w for _, w in self.projection_sizes]
        self.in_proj = quant_noise(
            nn.Linear(embed_dim, sum(w for _, w in self.projection_sizes)), q_noise, qn_block_size
        )
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.local_conv = LocalConv(
            conv_dim,
            kernel_size,
            dilation=dilation,
            weight_dropout=conv_weight_dropout,
            centered=centered_conv,
            impl=conv_heads_impl,
            # the factor on LocalConv ⊙ Query (1.0: the paper's unscaled product)
            output_scale=self.head_dim**-0.5 if output_scaling == "inv-sqrt-head-dim" else 1.0,
        )
        self.context_query = ContextQuery(
            conv_heads, self.head_dim, causal=causal, temperature=query_temperature
        )
        self.out_proj = quant_noise(nn.Linear(embed_dim, embed_dim), q_noise, qn_block_size)
        self.reset_parameters()

    @property
    def conv_heads_impl(self) -> str:
        """How the conv heads run: LocalConv's implementation, chosen at construction."""
        return self.local_conv.impl

    @property
    def conv_output_scale(self) -> float:
        """The factor on ``LocalConv ⊙ Query`` (1.0: the paper's unscaled product), which
        LocalConv applies."""
        return self.local_conv.output_scale

    def projection(self, name: str) -> Tuple[Tensor, Tensor]:
        """The weight (``width x d``) and bias of one slice of ``in_proj`` (views)."""
        start = 0
        for other, width in self.projection_sizes:
            if other == name:
                return self.in_proj.weight[start : start + width], self.in_proj.bias[
                    start : start + width
                ]
            start += width
        raise KeyError(
            f"no {name!r} projection (heads: {self.dot_heads} dot-product, {self.conv_heads} conv)"
        )

    def reset_parameters(self):
        # each slice initialised as its own nn.Linear would be; the q/k/v projections
        # scaled down by 1/sqrt(2), as in fairseq's MultiheadAttention
        with torch.no_grad():
            for name, _ in self.projection_sizes:
                weight, bias = self.projection(name)
                bias.zero_()
                if name == "pad":
                    weight.zero_()
                    continue
                gain = 1 / math.sqrt(2) if name in ("q", "k", "v") else 1.0
                nn.init.xavier_uniform_(weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Self-attention over ``query`` (``T x B x d``); ``key`` and ``value`` must be
        ``query`` itself (or None).

        Args:
            key_padding_mask: ``B x T``, True/1 at padding positions; in incremental
                decoding that of the new positions (as fairseq's decoder passes it) or
                ``B x S``, the cached past's included.
            incremental_state: when given, ``query`` holds only the new positions.
            need_weights: also return attention maps, averaged over heads (in
                incremental decoding over the dot-product heads: see below).
            attn_mask: additive (float) or boolean (True = masked) ``T x S`` mask for the
                dot-product heads. A causal module is causal without it; when given it
                is applied (explicitly: no fused causal kernel).
            need_head_weights: return the maps per head, ``H x B x T x S``: the first
                ``H - H_c`` are the dot-product heads' attention, the last ``H_c`` the
                conv heads' word-context (Query pooling) weights; in incremental
                decoding these are zeros (the Query keeps a running sum, not weights).

        Returns:
            ``(T x B x d output, weights or None)``
        """
        self._check_self_attention(query, key, value, static_kv, before_softmax)
        if need_head_weights:
            need_weights = True
        tgt_len, bsz, embed_dim = query.shape
        if self._one_search_step(
            tgt_len, incremental_state, need_weights, attn_mask, key_padding_mask
        ):
            return self._decode_step(query, incremental_state), None
        assert embed_dim == self.embed_dim, f"expected width {self.embed_dim}, got {embed_dim}"
        if key_padding_mask is not None:
            if self.right_padded and incremental_state is None:
                # causal and padded on the right: no real position sees a padding one
                key_padding_mask = None
            else:
                key_padding_mask = key_padding_mask.to(torch.bool)

        proj = self._project(query)
        heads = []
        dot_weights = None
        if self.dot_heads > 0:
            dot, dot_weights = self._dot_product_heads(
                proj["q"],
                proj["k"],
                proj["v"],
                key_padding_mask,
                incremental_state,
                attn_mask,
                need_weights,
            )
            heads.append(dot)
        # padding mask of the new positions only (the cached ones are already folded in)
        new_padding = key_padding_mask[:, -tgt_len:] if key_padding_mask is not None else None
        heads.append(self._conv_product(proj, new_padding, incremental_state))
        attn = self.out_proj(torch.cat(heads, dim=-1) if len(heads) > 1 else heads[0])

        weights: Optional[Tensor] = None
        if need_weights:
            weights = self._head_weights(proj["score"], new_padding, incremental_state, dot_weights)
            if not need_head_weights:
                kept = self.dot_heads if incremental_state is not None else 0
                weights = weights[:kept].mean(dim=0) if kept else weights.mean(dim=0)
        return attn, weights

    @staticmethod
    def _check_self_attention(query, key, value, static_kv, before_softmax) -> None:
        if static_kv or before_softmax:
            raise NotImplementedError("HybridMultiheadAttention is self-attention only")
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError(
                "HybridMultiheadAttention is self-attention only (key and value must be the "
                "query); cross-self-attention is not supported with convolution heads"
            )

    def _one_search_step(
        self, tgt_len, incremental_state, need_weights, attn_mask, key_padding_mask
    ) -> bool:
        """Whether this call is one position of a search and asks for nothing but the
        output (no weights, masks, gradients or dropout): :meth:`_decode_step` takes it,
        the rest of :meth:`forward` everything else."""
        return (
            incremental_state is not None
            and tgt_len == 1
            and not (need_weights or self.training or torch.is_grad_enabled())
            and attn_mask is None
            and key_padding_mask is None
            and not self.retains_dropout
        )

    @property
    def retains_dropout(self) -> bool:
        """Whether fairseq's ``--retain-dropout`` keeps a dropout of this module on in
        inference (Monte-Carlo dropout): the dot-product heads' attention dropout or
        LocalConv's DropConnect. Asked at every decoding step: the submodules are read
        from their dictionaries, without ``nn.Module``'s attribute lookups."""
        dot = self._modules["dropout_module"]
        conv = self._modules["local_conv"]._modules["weight_dropout_module"]
        for dropout in (dot, conv):
            if getattr(dropout, "apply_during_inference", False) and dropout.p > 0:
                return True
        return False

    def _dot_dropout_p(self) -> float:
        """The dot-product heads' attention dropout now: in training, and in inference
        under ``--retain-dropout``."""
        dropout = self.dropout_module
        return dropout.p if self.training or dropout.apply_during_inference else 0.0

    def head_outputs(
        self, x: Tensor, key_padding_mask: Optional[Tensor] = None
    ) -> Dict[str, Optional[Tensor]]:
        """The heads' outputs before ``W^O``, for analysis (no incremental state): ``dot``
        (``T x B x Ha·dh``, None without dot-product heads), ``local`` (LocalConv,
        ``T x B x Hc·dh``, the paper's equation 2 times the output scale, if any) and
        ``conv`` (``local ⊙ Query``)."""
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.to(torch.bool)
        proj = self._project(x)
        dot = None
        if self.dot_heads > 0:
            dot, _ = self._dot_product_heads(
                proj["q"], proj["k"], proj["v"], key_padding_mask, None, None, False
            )
        local, context = self._conv_heads(proj, key_padding_mask, None)
        return {"dot": dot, "local": local, "conv": local * context}

    def _decode_step(
        self, x: Tensor, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]
    ) -> Tensor:
        """One decoding step without padding and without autograd (beam search: fairseq
        decodes under ``torch.no_grad``): :meth:`forward`'s result with as few operations
        as possible, since it runs once per layer and output token and on a GPU each
        operation is a kernel launch. The keys and values are cached as one tensor, and
        the heads write their outputs straight into the input of ``W^O``. The projections
        are called as modules, as fairseq's attention calls its own: fairseq's scalar
        quantization (``--quant-noise-scalar``) replaces them by modules of its own."""
        bsz = x.size(1)
        proj = self.in_proj(x[0])  # B x width
        parts = dict(
            zip(self._names, proj.split_with_sizes(self._widths, dim=-1))
        )  # B x width each
        dot_dim = self.dot_heads * self.head_dim
        mixed = x.new_empty(bsz, self.embed_dim)  # the heads' outputs side by side
        if self.dot_heads > 0:
            # k and v are adjacent slices of the projection: B x 2*Ha*dh -> B x Ha x 2 x 1 x dh
            kv = (
                proj[:, dot_dim : 3 * dot_dim]
                .view(bsz, 2, self.dot_heads, 1, self.head_dim)
                .transpose(1, 2)
            )
            saved = self._get_input_buffer(incremental_state)
            kv, padding, _ = self._cache(saved, kv, None, 1)  # B x Ha x 2 x t x dh, B x t
            self._set_input_buffer(incremental_state, saved)
            q = parts["q"].view(bsz, self.dot_heads, 1, self.head_dim)  # B x Ha x 1 x dh
            if padding is None:
                # one fused kernel, the softmax in float32 inside
                dot = F.scaled_dot_product_attention(q, *kv.unbind(2))  # B x Ha x 1 x dh
            else:  # padded keys in the cache (never in beam search); the new one is not padding
                attend = ~padding[:, None, None, :]  # B x 1 x 1 x t
                dot = F.scaled_dot_product_attention(q, *kv.unbind(2), attn_mask=attend)
            # the kernel's output need not be laid out as B x Ha x dh in memory: copy, not
            # view; B x Ha*dh -> B x Ha x dh <- B x Ha x 1 x dh
            mixed[:, :dot_dim].view(bsz, self.dot_heads, self.head_dim).copy_(dot.squeeze(2))
        self._conv_step(parts, incremental_state, out=mixed[:, dot_dim:])
        return self.out_proj(mixed).unsqueeze(0)  # 1 x B x d

    def _conv_step(
        self,
        proj: Dict[str, Tensor],
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        out: Tensor,
    ) -> None:
        """The conv heads' output for one decoding step, written into ``out`` (``B x
        Hc·dh``, a slice of ``W^O``'s input): LocalConv's and the Query's steps (float32)
        and their product, cast as it is written; or all of it as one Triton kernel where
        asked for and possible (the same states either way)."""
        u = proj["local"]
        conv = self.local_conv
        if conv.receptive_field > 0 and conv_heads_triton.runs(self.conv_heads_impl, u):
            state = self.context_query.step_state(incremental_state)
            ring, row = conv.ring(u, incremental_state)
            _, state = conv_heads_triton.conv_step(
                u,
                proj["score"],
                proj["value"],
                conv.weight,
                ring,
                row,
                state,
                conv.dilation,
                self.context_query.temperature,
                conv.output_scale,
                out=out,
                check=False,
            )
            self.context_query.set_step_state(incremental_state, state)
            return
        local = conv.step(u, incremental_state)  # B x Hc*dh, float32
        context = self.context_query.step(
            proj["score"], proj["value"], incremental_state
        )  # B x Hc x dh, float32
        # B x Hc*dh -> B x Hc x dh; cast to out's dtype once, as it is written (as the
        # Triton step does)
        torch.mul(local.view(context.shape), context, out=out.view(context.shape))

    def _project(self, x: Tensor) -> Dict[str, Tensor]:
        """All input projections of ``x`` by one matrix product, ``T x B x width`` each."""
        parts = torch.split(self.in_proj(x), self._widths, dim=-1)  # T x B x width each
        return dict(zip(self._names, parts))

    def _conv_heads(
        self,
        proj: Dict[str, Tensor],
        padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
    ) -> Tuple[Tensor, Tensor]:
        """LocalConv (``T x B x Hc·dh``, the output scale applied in its float32 kernel)
        and the Query (``T x B x Hc·dh``, or ``1 x B x Hc·dh`` in the encoder, broadcasting
        over time) of the conv heads."""
        local = self.local_conv(proj["local"], padding_mask, incremental_state)
        context = self.context_query(proj["score"], proj["value"], padding_mask, incremental_state)
        return local, context

    def _conv_product(
        self,
        proj: Dict[str, Tensor],
        padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
    ) -> Tensor:
        """The conv heads' output ``LocalConv ⊙ Query`` (``T x B x Hc·dh``); for a whole
        sequence with ``--conv-heads-impl fused``, all of it as one Triton function
        (:func:`~tpp_plugin.modules.query_triton.conv_heads`)."""
        u = proj["local"]
        if (
            incremental_state is None
            and self.conv_heads_impl == "fused"
            and conv_heads_triton.runs("fused", u, operator=True)
        ):
            from .query_triton import conv_heads

            query = self.context_query
            weight, mask, scale, geometry = self.local_conv.fused_parts()
            return conv_heads(
                u,
                weight,
                proj["score"],
                proj["value"],
                padding_mask,
                query.num_heads,
                query.causal,
                query.temperature,
                geometry,
                mask,
                scale,
            )
        local, context = self._conv_heads(proj, padding_mask, incremental_state)
        return local * context  # LocalConv comes out scaled (output_scale)

    def _dot_product_heads(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        attn_mask: Optional[Tensor],
        need_weights: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """``q``, ``k``, ``v``: the projections of the new positions, ``T x B x (Ha·dh)``."""
        tgt_len, bsz, _ = q.shape
        device = q.device

        def heads_first(t: Tensor) -> Tensor:  # T x B x (Ha*dh) -> B x Ha x T x dh
            return t.reshape(t.size(0), bsz, self.dot_heads, self.head_dim).permute(1, 2, 0, 3)

        q, k, v = heads_first(q), heads_first(k), heads_first(v)
        past = 0
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            kv = torch.stack([k, v], dim=2)  # B x Ha x 2 x T x dh
            # B x Ha x 2 x (past + T) x dh, B x (past + T)
            kv, key_padding_mask, past = self._cache(saved, kv, key_padding_mask, tgt_len)
            self._set_input_buffer(incremental_state, saved)
            k, v = kv[:, :, 0], kv[:, :, 1]
        src_len = k.size(2)

        mask = self._dot_mask(attn_mask, key_padding_mask, tgt_len, src_len, past, q.dtype, device)
        use_causal_flag = mask is None and self.causal and tgt_len > 1 and past == 0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dot_dropout_p(), is_causal=use_causal_flag
        )  # B x Ha x T x dh
        weights = None
        if need_weights:
            # q scaled before the product, as fairseq's attention does: in half precision the
            # unscaled q·kᵀ could overflow
            logits = torch.matmul(q * self.scaling, k.transpose(-1, -2)).float()  # B x Ha x T x S
            if use_causal_flag:
                mask = self._causal_mask(tgt_len, src_len, past, device)
            if mask is not None:
                logits = (
                    logits.masked_fill(~mask, float("-inf"))
                    if mask.dtype == torch.bool
                    else logits + mask
                )
            weights = F.softmax(logits, dim=-1).type_as(q).transpose(0, 1)  # Ha x B x T x S
        # B x Ha x T x dh -> T x B x (Ha*dh)
        return out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, -1), weights

    @classmethod
    def _cache(
        cls,
        saved: Dict[str, Optional[Tensor]],
        kv: Tensor,
        key_padding_mask: Optional[Tensor],
        tgt_len: int,
    ) -> Tuple[Tensor, Optional[Tensor], int]:
        """The new positions' keys and values (``kv``, ``B x Ha x 2 x T x dh``) appended
        to the cache in ``saved``: all of them (``B x Ha x 2 x (past + T) x dh``), the
        padding of all keys (:meth:`_cached_padding`) and the number ``past`` cached
        before."""
        past = 0
        if saved.get("prev_kv") is not None:
            past = saved["prev_kv"].size(3)
            kv = torch.cat([saved["prev_kv"], kv], dim=3)  # B x Ha x 2 x (past + T) x dh
        saved["prev_kv"] = kv
        return kv, cls._cached_padding(saved, key_padding_mask, past, tgt_len), past

    @staticmethod
    def _cached_padding(
        saved: Dict[str, Optional[Tensor]],
        key_padding_mask: Optional[Tensor],
        past: int,
        tgt_len: int,
    ) -> Optional[Tensor]:
        """The padding of all ``past + T`` keys (``B x (past + T)``, None where none is
        padding), from the caller's mask (of the new positions, or of all of them) and
        the cached keys' (``saved["prev_padding"]``), which it updates."""
        prev = saved.get("prev_padding")
        if key_padding_mask is not None and key_padding_mask.size(1) == past + tgt_len:
            full = key_padding_mask  # the caller's, the cached past's included
        elif key_padding_mask is None and prev is None:
            return None
        else:  # one of the two, the other all False: B x past and B x T
            prev = (
                prev
                if prev is not None
                else key_padding_mask.new_zeros(key_padding_mask.size(0), past)
            )
            new = (
                key_padding_mask
                if key_padding_mask is not None
                else prev.new_zeros(prev.size(0), tgt_len)
            )
            full = torch.cat([prev, new], dim=1)  # B x (past + T)
        saved["prev_padding"] = full
        return full

    @staticmethod
    def _causal_mask(tgt_len: int, src_len: int, past: int, device) -> Tensor:
        """True where query ``past + i`` may attend key ``j`` (``j <= past + i``)."""
        rows = torch.arange(past, past + tgt_len, device=device)[:, None]  # T x 1
        return torch.arange(src_len, device=device)[None, :] <= rows  # 1 x S <= T x 1: T x S

    def _dot_mask(
        self,
        attn_mask: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        tgt_len: int,
        src_len: int,
        past: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Optional[Tensor]:
        """One mask for ``scaled_dot_product_attention`` from fairseq's three sources:
        the caller's ``attn_mask``, key padding and (decoder) causality. Boolean (True =
        attend) unless ``attn_mask`` is a float mask, in which case it is additive (in the
        computation's dtype: fairseq's future mask holds -inf, which half precision
        represents)."""
        masks = []
        if key_padding_mask is not None:
            masks.append(~key_padding_mask[:, None, None, :])  # B x 1 x 1 x S
        if self.causal and attn_mask is None and tgt_len > 1 and (masks or past > 0):
            # multi-position input with a padding mask or a cached past: the causal flag
            # cannot express it
            masks.append(self._causal_mask(tgt_len, src_len, past, device))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                masks.append(~attn_mask)
            else:
                additive = attn_mask.to(dtype)
                for m in masks:
                    additive = additive.masked_fill(~m, float("-inf"))
                return additive
        if not masks:
            return None
        combined = masks[0]
        for m in masks[1:]:
            combined = combined & m
        return combined

    def _head_weights(
        self,
        scores: Tensor,
        padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        dot_weights: Optional[Tensor],
    ) -> Tensor:
        """``H x B x T x S``: dot-product attention maps, then conv heads' Query weights."""
        tgt_len, bsz, _ = scores.shape
        if incremental_state is not None:
            # the Query pooled a running state; weights over the past are not kept
            src_len = dot_weights.size(-1) if dot_weights is not None else 1
            conv = scores.new_zeros(self.conv_heads, bsz, tgt_len, src_len)
        else:
            # B x Hc x T x S -> Hc x B x T x S
            conv = self.context_query.weights(scores, padding_mask).transpose(0, 1)
        return conv if dot_weights is None else torch.cat([dot_weights, conv], dim=0)

    def reorder_incremental_state(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        new_order: Tensor,
    ):
        """Reorder the dot-product heads' key/value cache to follow beam search.
        LocalConv and ContextQuery reorder their own state (fairseq visits them too)."""
        saved = self._get_input_buffer(incremental_state)
        if saved:
            for name, cached in saved.items():
                if cached is not None:
                    saved[name] = cached.index_select(0, new_order)
            self._set_input_buffer(incremental_state, saved)
        return incremental_state

    def _get_input_buffer(
        self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
    ) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        buffer: Dict[str, Optional[Tensor]],
    ):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def upgrade_state_dict_named(self, state_dict, name):
        """Fuse the separate input projections of checkpoints written before version
        0.2 into ``in_proj`` (:func:`fuse_legacy_projections`)."""
        fuse_legacy_projections(state_dict, f"{name}." if name else "")
        return state_dict

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, heads={self.num_heads} "
            f"(dot-product {self.dot_heads}, convolution {self.conv_heads}), "
            f"head_dim={self.head_dim}, causal={self.causal}, right_padded={self.right_padded}, "
            f"output_scaling={self.output_scaling}"
        )
