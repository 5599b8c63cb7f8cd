"""Adaptive query module ("context Query") of a Transformer++ convolution-attention head.

Two projections of the input ``S`` (``T x d``), for each of the ``H_c`` conv heads, and the
query, the softmax(over time)-weighted sum of the ``v_t``:

.. math::

    v_t = S_t W^S + b^S \\in \\mathbb{R}^{d_h}, \\qquad s_t = S_t W^Q + b^Q \\in \\mathbb{R}

    \\text{encoder:}\\quad q = \\sum_{\\tau} \\alpha_\\tau v_\\tau,\\quad
        \\alpha_\\tau = \\frac{e^{s_\\tau}}{\\sum_{\\tau'} e^{s_{\\tau'}}}
        \\quad(\\tau, \\tau' \\text{ over non-pad positions})

    \\text{decoder:}\\quad q_t = \\sum_{\\tau \\le t} \\alpha_{t,\\tau} v_\\tau,\\quad
        \\alpha_{t,\\tau} = \\frac{e^{s_\\tau}}{\\sum_{\\tau' \\le t} e^{s_{\\tau'}}}

i.e. a summary of the whole sentence (encoder) or of its prefix (decoder: a *prefix
softmax*, so that no position sees the future); ``α`` are the head's word-context weights
(:meth:`ContextQuery.weights`). ``temperature`` θ (``--conv-query-temperature``; 1, the
paper's) divides the scores, ``α_τ ∝ e^{s_τ / θ}``. ``W^S``, ``W^Q`` are slices of the
owning :class:`~tpp_plugin.modules.HybridMultiheadAttention`'s input projection.

A prefix is summed up by its mean ``q_t`` and log-normaliser ``L_t = log Σ_{τ≤t} e^{s_τ}``;
adjacent spans ``a`` (earlier) and ``b`` merge exactly and stably (the weight lies in
``[0, 1]``): ``L = logaddexp(L_a, L_b)``, ``q = q_a + e^{L_b - L} (q_b - q_a)``. Training
merges blocks of ``K`` = :data:`BLOCK` positions (``O(T·K)`` memory, not ``T x T``);
decoding keeps ``(L, q)`` per head (``B x H x (1 + d_h)``, float32): ``O(d_h)`` a step.
"""

import functools
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn

#: prefix-softmax block length ``K``: explicit ``K x K`` softmax inside a block
BLOCK = 64
#: the score given to padding positions: ``e^{MASKED - s}`` is 0 in float32 for any real
#: score, yet finite, so a prefix made of padding only averages its values instead of
#: dividing by zero (its output is never used)
MASKED = -1e9


@functools.lru_cache(maxsize=256)
def _future(length: int, device: torch.device) -> Tensor:
    """``length x length``, True where ``τ > t`` (column after row): the positions a
    prefix softmax leaves out. A constant of the shape alone, built once per length
    and device (blocks have at most :data:`BLOCK` positions), outside inference mode, so
    that autograd may keep it whatever mode the first call ran in."""
    with torch.inference_mode(False):
        return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


def merge_spans(q_a: Tensor, lse_a: Tensor, q_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Softmax-weighted mean and log-normaliser of two adjacent spans, ``a`` before
    ``b``: ``q_*`` is ``... x d``, ``lse_*`` is ``...``."""
    lse = torch.logaddexp(lse_a, lse_b)
    share_b = torch.exp(lse_b - lse).unsqueeze(-1)  # in [0, 1]
    return q_a + share_b * (q_b - q_a), lse


def _block_prefix(
    scores: Tensor, values: Tensor, future: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """Explicit prefix softmax over the last axis of ``scores`` (``... x K``) applied to
    ``values`` (``... x K x d``): returns ``... x K x d`` and ``... x K``. ``future``:
    the ``K x K`` mask of :func:`_future` (built here when not given)."""
    if future is None:
        future = _future(scores.size(-1), scores.device)
    # logits[..., t, τ] = s_τ for τ <= t
    logits = scores.unsqueeze(-2).masked_fill(future, float("-inf"))  # ... x K x K
    lse = torch.logsumexp(logits, dim=-1)  # ... x K
    weights = torch.exp(logits - lse.unsqueeze(-1))  # ... x K x K
    return torch.matmul(weights, values), lse


def prefix_softmax(scores: Tensor, values: Tensor, block: int = BLOCK) -> Tuple[Tensor, Tensor]:
    """``q_t = Σ_{τ≤t} softmax_{τ≤t}(s) v_τ`` and ``L_t = log Σ_{τ≤t} e^{s_τ}`` for
    ``scores`` ``... x T`` and ``values`` ``... x T x d`` (float32 in, float32 out), in
    ``O(T·block)`` memory."""
    length = scores.size(-1)
    if length <= block:
        return _block_prefix(scores, values)
    blocks = math.ceil(length / block)
    extra = blocks * block - length
    # positions after the end only follow the real ones: they cannot change them
    scores = F.pad(scores, (0, extra))
    values = F.pad(values, (0, 0, 0, extra))
    lead = scores.shape[:-1]
    dim = values.size(-1)
    q_in, lse_in = _block_prefix(
        scores.reshape(*lead, blocks, block),  # ... x n x K
        values.reshape(*lead, blocks, block, dim),  # ... x n x K x d
    )
    # totals of blocks 0..j (inclusive), from each block's last position
    q_tot, lse_tot = prefix_softmax(lse_in[..., -1], q_in[..., -1, :], block)  # ... x n (x d)
    # block j > 0 continues the total of blocks 0..j-1: totals ... x (n-1) x 1 (x d)
    q_rest, lse_rest = merge_spans(
        q_tot[..., :-1, None, :], lse_tot[..., :-1, None], q_in[..., 1:, :, :], lse_in[..., 1:, :]
    )
    # ... x n x K (x d) -> ... x nK (x d)
    q = torch.cat([q_in[..., :1, :, :], q_rest], dim=-3).reshape(*lead, blocks * block, dim)
    lse = torch.cat([lse_in[..., :1, :], lse_rest], dim=-2).reshape(*lead, blocks * block)
    return q[..., :length, :], lse[..., :length]


def prefix_softmax_padded(
    scores: Tensor, values: Tensor, block: int = BLOCK
) -> Tuple[Tensor, Tensor]:
    """:func:`prefix_softmax` in a form without branches on the length ``T``, for
    ``torch.compile`` (``T < (block - 2)·block``): always ``n = T // block + 2`` whole
    blocks (never one: a size of 1 would be a graph of its own), and the blocks' totals
    as one more block of ``block`` (``n`` of them real). Autograd differentiates it."""
    length = scores.size(-1)
    blocks = length // block + 2
    lead = scores.shape[:-1]
    future = torch.ones(block, block, dtype=torch.bool, device=scores.device).triu(1)
    scores = F.pad(scores, (0, blocks * block - length))  # positions after the end follow
    values = F.pad(values, (0, 0, 0, blocks * block - length))
    q_in, lse_in = _block_prefix(
        scores.reshape(*lead, blocks, block),  # ... x n x K
        values.reshape(*lead, blocks, block, values.size(-1)),  # ... x n x K x d
        future,
    )
    # totals of blocks 0..j (inclusive), from each block's last position; n <= K
    q_tot, lse_tot = _block_prefix(
        F.pad(lse_in[..., -1], (0, block - blocks)),  # ... x K
        F.pad(q_in[..., -1, :], (0, 0, 0, block - blocks)),  # ... x K x d
        future,
    )
    # block j continues the total of blocks 0..j-1 (nothing before block 0)
    lse_prev = F.pad(lse_tot[..., : blocks - 1], (1, 0), value=float("-inf"))  # ... x n
    q_prev = F.pad(q_tot[..., : blocks - 1, :], (0, 0, 1, 0))  # ... x n x d
    # ... x n x 1 x d and ... x n x 1 against each block's K positions
    q, lse = merge_spans(q_prev.unsqueeze(-2), lse_prev.unsqueeze(-1), q_in, lse_in)
    q = q.reshape(*lead, blocks * block, values.size(-1))  # ... x n x K x d -> ... x nK x d
    return q[..., :length, :], lse.reshape(*lead, blocks * block)[..., :length]


def prefix_softmax_transposed(scores: Tensor, lse: Tensor, x: Tensor, block: int = BLOCK) -> Tensor:
    """``y_τ = Σ_{t≥τ} e^{s_τ - L_t} x_t``: the transpose of the prefix softmax's weights
    (``A_{tτ} = e^{s_τ - L_t}``, ``τ ≤ t``), rebuilt from the scores and the
    log-normalisers ``L`` of :func:`prefix_softmax`, applied to ``x`` (``... x T x m``).
    Its backward pass is this product (see :class:`PooledQuery`).

    Inside a block the weights are an explicit ``K x K`` matrix. Across blocks, for
    ``τ`` in block ``j`` (last position ``e_j``) and ``t`` after it, the weight splits
    as ``e^{s_τ - L_{e_j}} · e^{L_{e_j} - L_t}``: both factors are at most 1 (``L`` only
    grows along the sequence), so ``G_j = Σ_{t > e_j} e^{L_{e_j} - L_t} x_t`` is one
    ``n x T`` matrix product and nothing overflows. Memory ``O(T·K + n·T)``, ``n = T/K``."""
    length = scores.size(-1)
    if length <= block:
        # weights[..., t, τ] = e^{s_τ - L_t} for τ <= t
        future = _future(length, scores.device)
        weights = torch.exp(
            (scores.unsqueeze(-2) - lse.unsqueeze(-1)).masked_fill(future, float("-inf"))
        )
        return torch.matmul(weights.transpose(-1, -2), x)
    blocks = math.ceil(length / block)
    extra = blocks * block - length
    # positions after the end weigh nothing either way: e^{-inf - L} = e^{s - inf} = 0
    scores = F.pad(scores, (0, extra), value=float("-inf"))
    lse = F.pad(lse, (0, extra), value=float("inf"))
    x = F.pad(x, (0, 0, 0, extra))
    lead = scores.shape[:-1]
    width = x.size(-1)
    y = prefix_softmax_transposed(
        scores.reshape(*lead, blocks, block),  # ... x n x K
        lse.reshape(*lead, blocks, block),  # ... x n x K
        x.reshape(*lead, blocks, block, width),  # ... x n x K x m
        block,
    ).reshape(*lead, blocks * block, width)  # ... x nK x m
    ends = lse.reshape(*lead, blocks, block)[..., -1]  # ... x n: L at each block's last position
    later = (torch.arange(blocks * block, device=x.device) // block)[None, :] > torch.arange(
        blocks, device=x.device
    )[:, None]  # n x T: t lies in a block after j
    carry = torch.exp(
        (ends.unsqueeze(-1) - lse.unsqueeze(-2)).masked_fill(~later, float("-inf"))
    )  # ... x n x T
    totals = torch.matmul(carry, x)  # ... x n x m: G_j
    share = torch.exp(scores.reshape(*lead, blocks, block) - ends.unsqueeze(-1))  # ... x n x K
    # ... x n x K x 1 times ... x n x 1 x m -> ... x nK x m
    y = y + (share.unsqueeze(-1) * totals.unsqueeze(-2)).reshape(*lead, blocks * block, width)
    return y[..., :length, :]


class PooledQuery(torch.autograd.Function):
    """The Query of a whole sequence at once (training: no incremental state), computed
    in float32 and returned in the values' dtype and layout (``T x B x H·d_h``).

    Autograd through :func:`prefix_softmax` would keep every block's ``K x K`` weights
    and a float32 copy of the values; this function keeps the scores and the values as
    given (slices of the fused input projection, which the layer keeps anyway) and, for
    float32 values only, its output and ``L``. Its backward pass, with ``g_t`` the
    output's gradient, ``A`` the pooling weights (``α_{t,τ}``) and ``c_t = -g_t · q_t``:

    .. math::

        \\frac{\\partial}{\\partial v_\\tau} = \\sum_{t} A_{t\\tau}\\, g_t, \\qquad
        \\frac{\\partial}{\\partial s_\\tau} = v_\\tau \\cdot \\frac{\\partial}{\\partial v_\\tau}
            + \\sum_{t} A_{t\\tau}\\, c_t

    one product with ``Aᵀ`` (:func:`prefix_softmax_transposed`; in the encoder every row
    of ``A`` is the same ``α``). It needs ``q`` and ``L`` in float32 (``v_τ - q_t`` can be
    far smaller than ``q_t``, and a rounded ``q`` would put its error, magnified, into
    the scores' gradient): with half-precision values both are computed again from the
    kept scores and values. A row whose whole prefix is padding (left padding in a
    decoder) has an ``L`` that float32 cannot tell apart from the masked score; its output
    is never used, and it gets no gradient here (its ``g_t`` is taken as 0)."""

    @staticmethod
    def forward(
        ctx, scores: Tensor, values: Tensor, num_heads: int, causal: bool, block: int
    ) -> Tensor:
        # scores: T x B x H float32 logits; values: T x B x (H*dh), any float dtype
        tgt_len, bsz, channels = values.shape
        query, lse = PooledQuery._pool(scores, values, num_heads, causal, block)
        if causal:  # B x H x T x dh -> T x B x (H*dh)
            out = query.permute(2, 0, 1, 3).reshape(tgt_len, bsz, channels)
        else:  # B x H x dh -> 1 x B x (H*dh)
            out = query.reshape(1, bsz, channels)
        out = out.to(values.dtype)
        if out.dtype == query.dtype:
            # float32 (or float64) values: the output is the query itself, which the layer's
            # product with LocalConv keeps anyway; keep it and L (one value per position
            # and head) rather than pool again in the backward pass
            ctx.save_for_backward(scores, values, out, lse)
        else:
            ctx.save_for_backward(scores, values)
        ctx.num_heads, ctx.causal, ctx.block = num_heads, causal, block
        return out

    @staticmethod
    def _pool(
        scores: Tensor, values: Tensor, heads: int, causal: bool, block: int
    ) -> Tuple[Tensor, Tensor]:
        return pool(scores, values, heads, causal, functools.partial(prefix_softmax, block=block))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        scores, values, *kept = ctx.saved_tensors
        tgt_len, bsz, channels = values.shape
        heads = ctx.num_heads
        # the forward's output, in float32: T x B x (H*dh) -> B x H x T x dh, or B x H x dh
        if kept:
            out, lse = kept
            query = out.view(-1, bsz, heads, channels // heads).permute(1, 2, 0, 3)
            # the encoder's: B x H x 1 x dh -> B x H x dh
            query = query if ctx.causal else query.squeeze(-2)
        else:
            query, lse = PooledQuery._pool(scores, values, heads, ctx.causal, ctx.block)
        acc = query.dtype
        s = scores.to(acc).permute(1, 2, 0)  # B x H x T
        v = values.to(acc).reshape(tgt_len, bsz, heads, -1).permute(1, 2, 0, 3)  # B x H x T x dh
        # T x B x (H*dh) -> B x H x T x dh (T = 1 in the encoder)
        g = grad_out.to(acc).reshape(grad_out.size(0), bsz, heads, -1).permute(1, 2, 0, 3)
        # the scores' gradient depends on v_τ - q_t only: centring both on the values' mean
        # keeps the products below small where the values share a large mean
        center = v.mean(dim=-2, keepdim=True)  # B x H x 1 x dh
        v = v - center
        query = query - (center if ctx.causal else center.squeeze(-2))
        if ctx.causal:
            c = -(g * query).sum(-1, keepdim=True)  # B x H x T x 1
            dead = (lse <= MASKED / 2).unsqueeze(-1)  # B x H x T x 1: rows that pool padding only
            y = prefix_softmax_transposed(  # of B x H x T x (dh + 1)
                s, lse, torch.cat([g, c], dim=-1).masked_fill(dead, 0.0), ctx.block
            )
            grad_v, grad_c = y[..., :-1], y[..., -1]  # A^T g, A^T c
            grad_s = (v * grad_v).sum(-1) + grad_c  # B x H x T
        else:
            weights = torch.exp(s - lse.unsqueeze(-1))  # B x H x T
            gv = (v * g).sum(-1)  # B x H x T: g · v_τ
            grad_v = weights.unsqueeze(-1) * g  # B x H x T x dh
            grad_s = weights * (gv - (g.squeeze(-2) * query).sum(-1, keepdim=True))  # g · (v_τ - q)
        # B x H x T x dh -> T x B x (H*dh)
        grad_values = grad_v.permute(2, 0, 1, 3).reshape(tgt_len, bsz, channels).to(values.dtype)
        return grad_s.permute(2, 0, 1), grad_values, None, None, None  # grad_s: T x B x H


def pool(
    scores: Tensor, values: Tensor, heads: int, causal: bool, prefix=prefix_softmax
) -> Tuple[Tensor, Tensor]:
    """The queries and log-normalisers of ``scores`` (``T x B x H``) and ``values``
    (``T x B x H·dh``) in float32 (float64 for float64 input): ``B x H x T x dh`` and
    ``B x H x T`` (causal, by ``prefix``), ``B x H x dh`` and ``B x H``."""
    tgt_len, bsz, _ = values.shape
    acc = torch.promote_types(values.dtype, torch.float32)
    s = scores.to(acc).permute(1, 2, 0)  # B x H x T
    v = values.to(acc).reshape(tgt_len, bsz, heads, -1).permute(1, 2, 0, 3)  # B x H x T x dh
    if causal:
        return prefix(s, v)
    lse = torch.logsumexp(s, dim=-1)  # B x H
    # B x H x 1 x T @ B x H x T x dh -> B x H x dh
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).unsqueeze(-2), v).squeeze(-2), lse


def pooled_query_traced(scores: Tensor, values: Tensor, heads: int, causal: bool) -> Tensor:
    """:class:`PooledQuery`'s output for ``torch.compile``: :func:`pool` through
    :func:`prefix_softmax_padded`, differentiated by autograd (which the compiler's
    partitioner decides what to keep for)."""
    tgt_len, bsz, channels = values.shape
    if causal:  # B x H x T x dh -> T x B x (H*dh)
        query, _ = pool(scores, values, heads, causal, prefix_softmax_padded)
        return query.permute(2, 0, 1, 3).reshape(tgt_len, bsz, channels).to(values.dtype)
    acc = torch.promote_types(values.dtype, torch.float32)
    weights = torch.softmax(scores.to(acc), dim=0).unsqueeze(-1)  # T x B x H x 1
    v = values.to(acc).view(tgt_len, bsz, heads, -1)  # T x B x H x dh
    return (weights * v).sum(0).reshape(1, bsz, channels).to(values.dtype)  # 1 x B x (H*dh)


@with_incremental_state
class ContextQuery(nn.Module):
    """Softmax-pooled summary of a sequence, per head; prefix-causal when ``causal``.

    Args:
        num_heads: ``H_c``.
        head_dim: ``d_h``.
        causal: prefix softmax (decoder) instead of a sentence-wide one (encoder).
        temperature: the scores are divided by it before the softmax (1: the paper).
    """

    def __init__(self, num_heads: int, head_dim: int, causal: bool, temperature: float = 1.0):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"the Query's pooling temperature must be > 0, got {temperature}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal = causal
        self.temperature = float(temperature)

    def _logits(self, scores: Tensor) -> Tensor:
        """The scores in float32 (float64 kept), divided by the temperature (exactly as
        given at 1)."""
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        return scores if self.temperature == 1.0 else scores / self.temperature

    def forward(
        self,
        scores: Tensor,
        values: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """
        Args:
            scores: ``s``, ``T x B x H`` (the new positions only, in incremental decoding).
            values: ``v``, ``T x B x (H·d_h)``.
            padding_mask: ``B x T``, True at padding positions (left out of the pooling).
            incremental_state: fairseq's incremental state (causal mode only).

        Returns:
            the queries in the layout of ``values``: ``1 x B x (H·d_h)`` for the
            sentence-wide query of the encoder (it broadcasts over time), ``T x B x
            (H·d_h)`` for the prefix queries of the decoder. Computed in float32,
            returned in the dtype of ``values``.
        """
        tgt_len, bsz, _ = values.shape
        scores = self._logits(scores)
        if padding_mask is not None:
            # B x T -> T x B x 1
            scores = scores.masked_fill(padding_mask.transpose(0, 1).unsqueeze(-1), MASKED)
        if incremental_state is None:
            if torch.compiler.is_compiling():  # no branch on the length: one graph for all
                return pooled_query_traced(scores, values, self.num_heads, self.causal)
            return PooledQuery.apply(scores, values, self.num_heads, self.causal, BLOCK)
        if not self.causal:
            raise RuntimeError("incremental decoding needs a causal ContextQuery")
        # one position after another; each query B x H x dh (float32) -> T x B x (H*dh)
        queries = [self._merge(s, v, incremental_state) for s, v in zip(scores, values)]
        return torch.stack(queries).reshape(tgt_len, bsz, -1).to(values.dtype)

    def step(
        self,
        scores: Tensor,
        values: Tensor,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
    ) -> Tensor:
        """One decoding step (causal), the module's only one (:meth:`forward` with an
        incremental state merges each new position the same way): ``scores`` ``B x H`` and
        ``values`` ``B x (H·d_h)`` of the new position; returns its query, ``B x H x d_h``
        **in float32** (the caller casts once, where it combines the heads)."""
        s = scores if self.temperature == 1.0 else self._logits(scores)  # B x H
        return self._merge(s, values, incremental_state)

    def _merge(
        self, s: Tensor, values: Tensor, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]
    ) -> Tensor:
        """Merge a new position (logits ``s`` ``B x H``, already divided by the temperature,
        and ``values``) into the running state ``(L, q)``: its weight ``e^{s - L'}`` with
        ``L' = logaddexp(L, s)`` is ``sigmoid(s - L)``, so

        .. math::

            L' = \\operatorname{logaddexp}(L, s), \\qquad
            q' = q + \\sigma(s - L)\\,(v - q),

        both written straight into a new state (a padding position, ``s = MASKED``,
        leaves ``(L, q)`` as they were, unless nothing came before it). Half-precision
        scores and values are promoted to float32 by the operations that read them."""
        bsz = values.size(0)
        v = values.view(bsz, self.num_heads, self.head_dim)  # B x H x dh, values' dtype
        s = s.unsqueeze(-1)  # B x H x 1
        state = self.step_state(incremental_state)  # B x H x (1 + dh), float32
        if state is None:  # the prefix of one position is itself
            new = torch.cat([s, v], dim=-1).float()
            self.set_step_state(incremental_state, new)
            return new[..., 1:]
        widths = (1, self.head_dim)
        lse, query = state.split_with_sizes(widths, dim=-1)  # B x H x 1, B x H x dh
        if torch.is_grad_enabled() and (s.requires_grad or v.requires_grad or state.requires_grad):
            # the same merge without out= (which autograd does not follow)
            share = torch.sigmoid(s - lse)
            new = torch.cat([torch.logaddexp(lse, s), query + share * (v - query)], dim=-1)
            self.set_step_state(incremental_state, new)
            return new[..., 1:]
        new = torch.empty_like(state)
        new_lse, new_query = new.split_with_sizes(widths, dim=-1)
        torch.logaddexp(lse, s, out=new_lse)
        share = torch.sigmoid(s - lse)  # B x H x 1, in [0, 1]
        if v.dtype == query.dtype:
            torch.lerp(query, v, share, out=new_query)  # q + share·(v - q)
        else:  # lerp takes one dtype only
            torch.addcmul(query, share, v - query, out=new_query)
        self.set_step_state(incremental_state, new)
        return new_query

    def weights(self, scores: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        """The word-context weights ``α`` (for visualisation): ``B x H x T x T``, row ``t``
        the distribution the query of position ``t`` pools with (in the encoder every row
        is the same sentence-wide distribution). ``scores`` is ``T x B x H``."""
        tgt_len = scores.size(0)
        # T x B x H -> B x H x T x T (every row the same before the masks)
        logits = self._logits(scores).permute(1, 2, 0).unsqueeze(2).expand(-1, -1, tgt_len, -1)
        allowed = None
        if padding_mask is not None:
            allowed = ~padding_mask[:, None, None, :]  # B x 1 x 1 x T
        if self.causal:
            causal = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=scores.device).tril()
            # a padding row still pools its own position, so no softmax is ever empty
            diagonal = torch.eye(tgt_len, dtype=torch.bool, device=scores.device)
            allowed = causal if allowed is None else (causal & allowed) | diagonal
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        return F.softmax(logits, dim=-1).type_as(scores)

    def step_state(
        self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]
    ) -> Optional[Tensor]:
        """The running state ``(L, q)`` of the decoded prefix, ``B x H x (1 + d_h)``
        float32 (None before the first position)."""
        return self._get_input_buffer(incremental_state).get("state")

    def set_step_state(
        self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], state: Tensor
    ) -> None:
        self._set_input_buffer(incremental_state, {"state": state})

    def reorder_incremental_state(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        new_order: Tensor,
    ):
        """Reorder the running state to follow beam search (this module's state only)."""
        buffer = self._get_input_buffer(incremental_state)
        state = buffer.get("state")
        if state is not None:
            buffer["state"] = state.index_select(0, new_order)
            self._set_input_buffer(incremental_state, buffer)

    def _get_input_buffer(
        self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
    ) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "context_query")
        return result if result is not None else {}

    def _set_input_buffer(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        buffer: Dict[str, Optional[Tensor]],
    ):
        return self.set_incremental_state(incremental_state, "context_query", buffer)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}, "
            f"temperature={self.temperature:g}"
        )
