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

``LocalConv`` is :mod:`~tpp_plugin.modules.local_conv` and ``Query`` is
:mod:`~tpp_plugin.modules.context_query`.

How we read the paper's combination. The paper writes
``DynamicConv(S) = Conv1D(LocalConv, Query)`` and says that this "is simply computing
the dot product between LocalConv and Query", with LocalConv "conceptually similar to
the key" and DynamicConv "as the value". A full dot product would give one scalar per
position and head, which cannot be a head output of width ``d_h`` that is concatenated
with the others and mixed by ``W^O``. We therefore read it as a convolution of width
one whose kernel is the Query: the channel-wise product of the local representation
at each position with the head's sentence (or prefix) summary. The head keeps shape
``T x d_h``; the sum over channels that completes the dot product is left to ``W^O``,
which mixes the channels of all heads anyway. The word-context relation the paper
describes lives in the pooling weights of the Query (which words matter to the
context); :meth:`HybridMultiheadAttention.forward` returns them as the conv heads'
attention maps when weights are asked for.

The module is a drop-in for fairseq's :class:`~fairseq.modules.MultiheadAttention` in
the *self*-attention slot of encoder and decoder layers: same call signature, same
``T x B x d`` layout, same incremental-state protocol (``prev_key``/``prev_value`` for
the dot-product heads; :class:`LocalConv` and :class:`ContextQuery` keep their own
bounded states and reorder them themselves, since fairseq calls
``reorder_incremental_state`` on every submodule).
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

from .context_query import ContextQuery
from .local_conv import LocalConv


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
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0 < conv_heads <= num_heads:
            raise ValueError(f"conv_heads must be in 1..{num_heads}, got {conv_heads}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.conv_heads = conv_heads
        self.dot_heads = num_heads - conv_heads
        self.causal = causal
        self.scaling = self.head_dim**-0.5
        # fairseq's layers and tools look for these MultiheadAttention attributes
        self.kdim = self.vdim = embed_dim
        self.self_attention = True
        self.encoder_decoder_attention = False

        dot_dim = self.dot_heads * self.head_dim
        conv_dim = conv_heads * self.head_dim
        if self.dot_heads > 0:
            self.q_proj = nn.Linear(embed_dim, dot_dim)
            self.k_proj = nn.Linear(embed_dim, dot_dim)
            self.v_proj = nn.Linear(embed_dim, dot_dim)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.local_conv = LocalConv(
            embed_dim, conv_dim, kernel_size, dilation=dilation, weight_dropout=conv_weight_dropout
        )
        self.context_query = ContextQuery(embed_dim, conv_heads, self.head_dim, causal=causal)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.reset_parameters()

    def reset_parameters(self):
        # as fairseq's MultiheadAttention: the q/k/v projections are scaled down by 1/sqrt(2)
        if self.dot_heads > 0:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
                nn.init.constant_(proj.bias, 0.0)
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
            key_padding_mask: ``B x T`` (``B x S`` with the cached past in incremental
                decoding), True/1 at padding positions.
            incremental_state: when given, ``query`` holds only the new positions.
            need_weights: also return attention maps, averaged over heads.
            attn_mask: additive (float) or boolean (True = masked) ``T x S`` mask for the
                dot-product heads, as fairseq's decoder passes its future mask; causality
                of a decoder module does not depend on it.
            need_head_weights: return the maps per head, ``H x B x T x S``: the first
                ``H - H_c`` are the dot-product heads' attention, the last ``H_c`` the
                conv heads' word-context (Query pooling) weights.

        Returns:
            ``(T x B x d output, weights or None)``
        """
        if static_kv or before_softmax:
            raise NotImplementedError("HybridMultiheadAttention is self-attention only")
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError(
                "HybridMultiheadAttention is self-attention only (key and value must be the "
                "query); cross-self-attention is not supported with convolution heads"
            )
        if need_head_weights:
            need_weights = True
        tgt_len, bsz, embed_dim = query.shape
        assert embed_dim == self.embed_dim, f"expected width {self.embed_dim}, got {embed_dim}"
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.to(torch.bool)
            if not key_padding_mask.any():
                key_padding_mask = None

        # padding mask of the new positions only (the cached ones are already folded in)
        new_padding = key_padding_mask[:, -tgt_len:] if key_padding_mask is not None else None

        # every projection of the input in one matrix product (q, k, v of the dot-product
        # heads, LocalConv's pointwise part, the Query's values and scores)
        projected = self._project(query)
        heads = []
        dot_weights = None
        if self.dot_heads > 0:
            q, k, v = projected[:3]
            dot_out, dot_weights = self._dot_product_heads(
                q, k, v, key_padding_mask, incremental_state, attn_mask, need_weights
            )
            heads.append(dot_out)
        pointwise, values, scores = projected[-3:]
        local = self.local_conv.convolve_projected(pointwise, new_padding, incremental_state)
        scores, values = self.context_query.arrange(scores, values)
        # B x Hc x T|1 x dh
        context = self.context_query.pool(scores, values, new_padding, incremental_state)
        context = context.permute(2, 0, 1, 3).reshape(-1, bsz, self.conv_heads * self.head_dim)
        heads.append(local * context)
        attn = self.out_proj(torch.cat(heads, dim=-1) if len(heads) > 1 else heads[0])

        weights: Optional[Tensor] = None
        if need_weights:
            weights = self._head_weights(query, new_padding, incremental_state, dot_weights)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return attn, weights

    def head_outputs(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Dict[str, Optional[Tensor]]:
        """The heads' outputs before ``W^O``, for analysis (no incremental state): ``dot``
        (``T x B x Ha·dh``, None without dot-product heads), ``local`` (LocalConv,
        ``T x B x Hc·dh``, the paper's equation 2) and ``conv`` (``local ⊙ Query``)."""
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.to(torch.bool)
        projected = self._project(x)
        dot = None
        if self.dot_heads > 0:
            q, k, v = projected[:3]
            dot, _ = self._dot_product_heads(q, k, v, key_padding_mask, None, None, False)
        pointwise, values, scores = projected[-3:]
        local = self.local_conv.convolve_projected(pointwise, key_padding_mask, None)
        scores, values = self.context_query.arrange(scores, values)
        context = self.context_query.pool(scores, values, key_padding_mask, None)
        context = context.permute(2, 0, 1, 3).reshape(-1, x.size(1), self.conv_heads * self.head_dim)
        return {"dot": dot, "local": local, "conv": local * context}

    def _input_projections(self):
        """The ``nn.Linear`` modules applied to the input, in the order of :meth:`_project`."""
        dot = [self.q_proj, self.k_proj, self.v_proj] if self.dot_heads > 0 else []
        cq = self.context_query
        return dot + [self.local_conv.pointwise, cq.value_proj, cq.score_proj]

    def _fused_weight(self) -> Tuple[Tensor, Tensor]:
        """The input projections' weights and biases stacked (rows in the order of
        :meth:`_input_projections`). Without autograd (decoding) the stack is kept and
        rebuilt only when a parameter changes (it is cheap, but decoding calls this once
        per layer and step)."""
        params = [p for lin in self._input_projections() for p in (lin.weight, lin.bias)]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            self._fused_cache = None
            return torch.cat(params[0::2]), torch.cat(params[1::2])
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        cache = getattr(self, "_fused_cache", None)
        if cache is None or cache[0] != key:
            cache = (key, torch.cat(params[0::2]), torch.cat(params[1::2]))
            self._fused_cache = cache
        return cache[1], cache[2]

    def _project(self, x: Tensor):
        """All input projections of ``x`` by one matrix product, split per projection."""
        weight, bias = self._fused_weight()
        sizes = [lin.out_features for lin in self._input_projections()]
        return torch.split(F.linear(x, weight, bias), sizes, dim=-1)

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
        x = q

        def heads_first(t: Tensor) -> Tensor:  # T x B x (Ha*dh) -> B x Ha x T x dh
            return t.reshape(t.size(0), bsz, self.dot_heads, self.head_dim).permute(1, 2, 0, 3)

        q = heads_first(q)
        k = heads_first(k)
        v = heads_first(v)
        past = 0
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            prev_key = saved.get("prev_key")
            prev_value = saved.get("prev_value")
            if prev_key is not None and prev_value is not None:
                past = prev_key.size(2)
                k = torch.cat([prev_key, k], dim=2)
                v = torch.cat([prev_value, v], dim=2)
            saved["prev_key"] = k
            saved["prev_value"] = v
            self._set_input_buffer(incremental_state, saved)
        src_len = k.size(2)

        mask = self._dot_mask(attn_mask, key_padding_mask, tgt_len, src_len, past, x)
        use_causal_flag = mask is None and self.causal and tgt_len > 1 and past == 0
        dropout_p = self.dropout_module.p if self.training else 0.0
        if tgt_len == 1 and dropout_p == 0.0:
            # a decoding step: for one query, two small matrix products beat the fused
            # kernel's set-up on CPU (same softmax(q k^T / sqrt(d_h) + mask) v)
            logits = torch.matmul(q * self.scaling, k.transpose(-1, -2))
            if mask is not None:
                logits = (
                    logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
                )
            out = torch.matmul(F.softmax(logits, dim=-1, dtype=torch.float32).type_as(v), v)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=use_causal_flag
            )
        weights = None
        if need_weights:
            logits = torch.matmul(q, k.transpose(-1, -2)).float() * self.scaling
            if use_causal_flag:
                mask = self._causal_mask(tgt_len, src_len, past, x.device)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
            weights = F.softmax(logits, dim=-1).type_as(q).transpose(0, 1)  # Ha x B x T x S
        return out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, -1), weights

    @staticmethod
    def _causal_mask(tgt_len: int, src_len: int, past: int, device) -> Tensor:
        """True where query ``past + i`` may attend key ``j`` (``j <= past + i``)."""
        rows = torch.arange(past, past + tgt_len, device=device)[:, None]
        return torch.arange(src_len, device=device)[None, :] <= rows

    def _dot_mask(
        self,
        attn_mask: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        tgt_len: int,
        src_len: int,
        past: int,
        x: Tensor,
    ) -> Optional[Tensor]:
        """One mask for ``scaled_dot_product_attention`` from fairseq's three sources:
        the caller's ``attn_mask``, key padding and (decoder) causality. Boolean (True =
        attend) unless ``attn_mask`` is a float mask, in which case it is additive."""
        masks = []
        if key_padding_mask is not None:
            masks.append(~key_padding_mask[:, None, None, :])
        if self.causal and (attn_mask is None) and (tgt_len > 1) and (masks or past > 0):
            # multi-position input without the caller's future mask (incremental
            # decoding of several positions at once, or padding forcing an explicit mask)
            masks.append(self._causal_mask(tgt_len, src_len, past, x.device))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                masks.append(~attn_mask)
            else:
                additive = attn_mask.to(x.dtype)
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
        x: Tensor,
        padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        dot_weights: Optional[Tensor],
    ) -> Tensor:
        """``H x B x T x S``: dot-product attention maps, then conv heads' Query weights."""
        if incremental_state is not None:
            # the Query pooled a running state; weights over the past are not kept
            conv = x.new_zeros(self.conv_heads, x.size(1), x.size(0), 1)
            if dot_weights is not None:
                conv = conv.new_zeros(self.conv_heads, *dot_weights.shape[1:])
        else:
            conv = self.context_query.weights(x, padding_mask).transpose(0, 1)
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
        return state_dict

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, heads={self.num_heads} "
            f"(dot-product {self.dot_heads}, convolution {self.conv_heads}), "
            f"head_dim={self.head_dim}, causal={self.causal}"
        )
