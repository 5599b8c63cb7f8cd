"""The conv heads as Triton kernels for training (``--conv-heads-impl fused``):
``LocalConv(u) ⊙ Query(s, v)`` in one launch forward, three backward, per layer.

Forward, one program per (sentence, conv head), over time in blocks of ``BLOCK_T`` rows:
LocalConv's kernel (its weight's softmax over the taps times DropConnect's mask) and its
taps summed in float32, written in ``u``'s dtype; the scores divided by the temperature
and masked at padding; the pooling of
:class:`~tpp_plugin.modules.context_query.PooledQuery` (encoder: one softmax over the
sentence; decoder: the prefix softmax as one ``tl.associative_scan`` of ``(L, q)`` pairs
under :func:`~tpp_plugin.modules.context_query.merge_spans`' merge, carried from block to
block); and ``out_t = scale · local_t ⊙ q_t`` in float32, cast once as it is written. Kept
besides the inputs: LocalConv's rows, its kernel (``F x C``) and softmax (``C x F``), and
``L`` (the decoder's ``B x H x T`` log-normalisers; the encoder's ``(L, q)``, ``B x H x
(1 + d_h)``): no float32 tensor larger than the scores.

Backward, one program per (sentence, head), with ``γ_t = scale · ∂out_t ⊙ local_t`` the
query's gradient: ``∂local_t = scale · ∂out_t ⊙ q_t`` and PooledQuery's gradients. In the
decoder ``q_t`` is computed again by the same scan (centred on the values' mean, ``c_t =
-γ_t · (q_t - μ)`` kept in a scratch row), and ``Aᵀ`` by one reversed scan of the recurrence

.. math::

    R_t = x_t + e^{L_t - L_{t+1}} R_{t+1}, \\qquad
    (A^\\top x)_\\tau = e^{s_\\tau - L_\\tau} R_\\tau

whose factors are at most 1 (``L`` only grows along the sequence): no ``T x T`` or blocked
matrix. Then LocalConv's input and kernel gradients from ``∂local`` by its two kernels
(:mod:`~tpp_plugin.modules.conv_heads_triton`), and the weight's through the mask and
the softmax.
"""

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from .conv_heads_triton import _device_of, conv_grads
from .context_query import MASKED

#: time rows per block of a program: a ``BLOCK_T x d_h`` float32 tile per operand of the scans
BLOCK_T = 32
#: the score of padding positions (:data:`~tpp_plugin.modules.context_query.MASKED`), a kernel constant
MASKED_SCORE = tl.constexpr(MASKED)
#: the kernels compute in float32, or in float64 for float64 input
_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _merge(l_a, q_a, l_b, q_b):
    """(log-normaliser, mean) of span ``a`` followed by span ``b``."""
    top = tl.maximum(l_a, l_b)
    lse = top + tl.log(tl.exp(l_a - top) + tl.exp(l_b - top))
    return lse, q_a + tl.exp(l_b - lse) * (q_b - q_a)


@triton.jit
def _affine(a1, x1, a2, x2):
    """``h -> a2 (a1 h + x1) + x2``: two steps of ``h_i = a_i h_{i-1} + x_i``."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _last_row(x, rows, BLOCK_T: tl.constexpr):
    """The block's last row of ``x`` (``BLOCK_T x BLOCK_D`` -> ``BLOCK_D``)."""
    return tl.sum(tl.where((rows == BLOCK_T - 1)[:, None], x, 0.0), axis=0)


@triton.jit
def _last(x, rows, BLOCK_T: tl.constexpr):
    """The block's last element of ``x`` (``BLOCK_T`` -> a scalar)."""
    return tl.sum(tl.where(rows == BLOCK_T - 1, x, 0.0), axis=0)


@triton.jit
def _scores(
    s_ptr,
    pad_ptr,
    t,
    ok,
    b,
    h,
    sst,
    ssb,
    spb,
    spt,
    temperature,
    HAS_PAD: tl.constexpr,
    ACC: tl.constexpr,
):
    """The rows' scores in ``ACC`` divided by the temperature; MASKED at padding and past the end."""
    s = tl.load(s_ptr + t.to(tl.int64) * sst + b * ssb + h, mask=ok, other=0.0).to(ACC)
    s = s / temperature
    keep = ok
    if HAS_PAD:
        pad = tl.load(pad_ptr + b * spb + t.to(tl.int64) * spt, mask=ok, other=1)
        keep = keep & (pad == 0)
    return tl.where(keep, s, MASKED_SCORE), keep


@triton.jit
def _rows(ptr, t, ok, b, c, d_ok, st, sb, ACC: tl.constexpr):
    """``BLOCK_T x BLOCK_D`` tile in ``ACC`` of a ``T x B x C`` tensor (zeros outside)."""
    both = ok[:, None] & d_ok[None, :]
    x = tl.load(ptr + t.to(tl.int64)[:, None] * st + b * sb + c[None, :], mask=both, other=0.0)
    return x.to(ACC)


@triton.jit
def _store_rows(ptr, x, t, ok, b, c, d_ok, st, sb):
    both = ok[:, None] & d_ok[None, :]
    tl.store(
        ptr + t.to(tl.int64)[:, None] * st + b * sb + c[None, :],
        x.to(ptr.dtype.element_ty),
        mask=both,
    )


@triton.jit
def _kernel_softmax(w_ptr, c, d_ok, taps, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """The largest of each channel's ``taps`` weights (LocalConv's ``C x F``, contiguous)
    and the sum of their exponentials after it: the softmax's two statistics."""
    top = tl.full((BLOCK_D,), float("-inf"), ACC)
    for k in range(taps):
        top = tl.maximum(top, tl.load(w_ptr + c * taps + k, mask=d_ok, other=0.0).to(ACC))
    total = tl.zeros((BLOCK_D,), ACC)
    for k in range(taps):
        total += tl.exp(tl.load(w_ptr + c * taps + k, mask=d_ok, other=0.0).to(ACC) - top)
    return top, total


@triton.jit
def _tap(w_ptr, m_ptr, k, c, d_ok, taps, top, total, HAS_MASK: tl.constexpr, ACC: tl.constexpr):
    """Tap ``k`` of LocalConv's kernel for the channels ``c``: the weight's softmax over
    the taps, times DropConnect's mask (``C x F``, contiguous) where there is one."""
    w = tl.exp(tl.load(w_ptr + c * taps + k, mask=d_ok, other=0.0).to(ACC) - top) / total
    if HAS_MASK:
        w = w * tl.load(m_ptr + c * taps + k, mask=d_ok, other=0.0).to(ACC)
    return w


@triton.jit
def _local(
    u_ptr, w_ptr, m_ptr, pad_ptr, local_ptr, t, ok, b, c, d_ok, length, sut, sub, spb, spt,
    slt, slb, shift, dilation, taps, top, total, HAS_MASK: tl.constexpr,
    HAS_PAD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """LocalConv's rows, ``Σ_k K_k ⊙ u_{t - shift + k·δ}`` (padding read as zero) summed in
    ``ACC``, written to ``local`` in its dtype (for the backward pass) and returned as
    written."""
    acc = tl.zeros((t.shape[0], c.shape[0]), ACC)
    for k in range(taps):
        src = t - shift + k * dilation
        read = ok & (src >= 0) & (src < length)
        if HAS_PAD:
            read = read & (
                tl.load(pad_ptr + b * spb + src.to(tl.int64) * spt, mask=read, other=1) == 0
            )
        x = _rows(u_ptr, src, read, b, c, d_ok, sut, sub, ACC)
        w = _tap(w_ptr, m_ptr, k, c, d_ok, taps, top, total, HAS_MASK, ACC)
        acc += x * w[None, :]
    _store_rows(local_ptr, acc, t, ok, b, c, d_ok, slt, slb)
    return acc.to(local_ptr.dtype.element_ty).to(ACC)


@triton.jit
def _kernel_out(
    w_ptr, m_ptr, soft_ptr, kern_ptr, c, d_ok, channels, taps, top, total,
    HAS_MASK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The head's channels of the softmax (``C x F``) and of the kernel (``F x C``, the
    mask applied), for the backward pass."""
    for k in range(taps):
        w = _tap(w_ptr, m_ptr, k, c, d_ok, taps, top, total, False, ACC)  # the softmax's
        tl.store(soft_ptr + c * taps + k, w, mask=d_ok)
        if HAS_MASK:
            w = w * tl.load(m_ptr + c * taps + k, mask=d_ok, other=0.0).to(ACC)
        tl.store(kern_ptr + k * channels + c, w, mask=d_ok)


@triton.jit
def _prefix(s, v, carry_l, carry_q, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The block's prefix ``(L_t, q_t)`` continuing the carry ``(L, q)`` of the blocks before."""
    lse = tl.broadcast_to(s[:, None], (BLOCK_T, BLOCK_D))
    lse, q = tl.associative_scan((lse, v), 0, _merge)
    return _merge(carry_l[None, :], carry_q[None, :], lse, q)


# the integers that change with the batch are passed as they are: specialised (== 1,
# divisible by 16), each new class would be a compilation
@triton.jit(do_not_specialize=["length"])
def conv_heads_kernel(
    s_ptr, v_ptr, pad_ptr, local_ptr, out_ptr, lse_ptr, u_ptr, w_ptr, m_ptr, soft_ptr,
    kern_ptr, length, heads, head_dim, temperature, out_scale, sst, ssb, svt, svb, spb,
    spt, slt, slb, sot, sob, sut, sub, shift, dilation, taps, CAUSAL: tl.constexpr,
    ACC: tl.constexpr, HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)  # sentence
    h = tl.program_id(1)  # conv head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    c = (h * head_dim + d).to(tl.int64)  # the head's channels
    rows = tl.arange(0, BLOCK_T)
    row = b * heads + h  # the head's row of lse
    top, total = _kernel_softmax(w_ptr, c, d_ok, taps, ACC, BLOCK_D)
    if b == 0:  # the kernel, once
        _kernel_out(
            w_ptr, m_ptr, soft_ptr, kern_ptr, c, d_ok, heads * head_dim, taps, top, total,
            HAS_MASK, ACC,
        )  # fmt: skip
    carry_l = tl.full((BLOCK_D,), float("-inf"), ACC)
    carry_q = tl.zeros((BLOCK_D,), ACC)
    for start in range(0, length, BLOCK_T):
        t = start + rows
        ok = t < length
        s, _ = _scores(s_ptr, pad_ptr, t, ok, b, h, sst, ssb, spb, spt, temperature, HAS_PAD, ACC)
        v = _rows(v_ptr, t, ok, b, c, d_ok, svt, svb, ACC)
        if CAUSAL:
            lse, q = _prefix(s, v, carry_l, carry_q, BLOCK_T, BLOCK_D)
            tl.store(lse_ptr + row * length + t, tl.max(lse, axis=1), mask=ok)
            local = _local(
                u_ptr, w_ptr, m_ptr, pad_ptr, local_ptr, t, ok, b, c, d_ok, length, sut, sub,
                spb, spt, slt, slb, shift, dilation, taps, top, total, HAS_MASK, HAS_PAD, ACC,
            )  # fmt: skip
            _store_rows(out_ptr, local * q * out_scale, t, ok, b, c, d_ok, sot, sob)
            carry_l, carry_q = _last_row(lse, rows, BLOCK_T), _last_row(q, rows, BLOCK_T)
        else:  # the block's own softmax, merged into the sentence's
            top_s = tl.max(s, axis=0)
            e = tl.exp(s - top_s)
            sum_e = tl.sum(e, axis=0)
            carry_l, carry_q = _merge(
                carry_l, carry_q, top_s + tl.log(sum_e), tl.sum(e[:, None] * v, axis=0) / sum_e
            )
    if not CAUSAL:  # (L, q) of the sentence, then the product at every position
        state = lse_ptr + row * (head_dim + 1)
        tl.store(state, tl.max(carry_l, axis=0))
        tl.store(state + 1 + d, carry_q, mask=d_ok)
        for start in range(0, length, BLOCK_T):
            t = start + rows
            ok = t < length
            local = _local(
                u_ptr, w_ptr, m_ptr, pad_ptr, local_ptr, t, ok, b, c, d_ok, length, sut, sub,
                spb, spt, slt, slb, shift, dilation, taps, top, total, HAS_MASK, HAS_PAD, ACC,
            )  # fmt: skip
            _store_rows(
                out_ptr, local * (carry_q * out_scale)[None, :], t, ok, b, c, d_ok, sot, sob
            )


@triton.jit(do_not_specialize=["length", "bsz"])
def conv_heads_grad_kernel(
    g_ptr, s_ptr, v_ptr, pad_ptr, local_ptr, lse_ptr, c_ptr, grad_local_ptr, grad_s_ptr,
    grad_v_ptr, length, bsz, heads, head_dim, temperature, out_scale, sgt, sgb, sst, ssb, svt,
    svb, spb, spt, slt, slb, CAUSAL: tl.constexpr, ACC: tl.constexpr, HAS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # the gradients are written in the layouts of their inputs, contiguous
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    channels = heads * head_dim
    c = (h * head_dim + d).to(tl.int64)
    rows = tl.arange(0, BLOCK_T)
    row = b * heads + h
    if not CAUSAL:
        state = lse_ptr + row * (head_dim + 1)
        lse = tl.load(state)
        q = tl.load(state + 1 + d, mask=d_ok, other=0.0)
        gamma = tl.zeros((BLOCK_D,), ACC)  # Σ_t ∂out_t ⊙ local_t: the query's gradient
        for start in range(0, length, BLOCK_T):
            t = start + rows
            ok = t < length
            g = _rows(g_ptr, t, ok, b, c, d_ok, sgt, sgb, ACC) * out_scale
            gamma += tl.sum(g * _rows(local_ptr, t, ok, b, c, d_ok, slt, slb, ACC), axis=0)
            _store_rows(grad_local_ptr, g * q[None, :], t, ok, b, c, d_ok, bsz * channels, channels)
        for start in range(0, length, BLOCK_T):
            t = start + rows
            ok = t < length
            s, keep = _scores(
                s_ptr, pad_ptr, t, ok, b, h, sst, ssb, spb, spt, temperature, HAS_PAD, ACC
            )
            v = _rows(v_ptr, t, ok, b, c, d_ok, svt, svb, ACC)
            alpha = tl.where(keep, tl.exp(s - lse), 0.0)
            grad_s = alpha * tl.sum((v - q[None, :]) * gamma[None, :], axis=1) / temperature
            tl.store(
                grad_s_ptr + t.to(tl.int64) * bsz * heads + b * heads + h,
                grad_s.to(grad_s_ptr.dtype.element_ty),
                mask=ok,
            )
            grad_v = alpha[:, None] * gamma[None, :]
            _store_rows(grad_v_ptr, grad_v, t, ok, b, c, d_ok, bsz * channels, channels)
    else:
        # the values' mean, on which q_t and v_τ are centred (their difference is what counts)
        mean = tl.zeros((BLOCK_D,), ACC)
        for start in range(0, length, BLOCK_T):
            t = start + rows
            mean += tl.sum(_rows(v_ptr, t, t < length, b, c, d_ok, svt, svb, ACC), axis=0)
        mean = mean / length
        # forward in time: q_t again, ∂local_t, and c_t = -γ_t · (q_t - μ) into the scratch row
        carry_l = tl.full((BLOCK_D,), float("-inf"), ACC)
        carry_q = tl.zeros((BLOCK_D,), ACC)
        for start in range(0, length, BLOCK_T):
            t = start + rows
            ok = t < length
            s, _ = _scores(
                s_ptr, pad_ptr, t, ok, b, h, sst, ssb, spb, spt, temperature, HAS_PAD, ACC
            )
            v = _rows(v_ptr, t, ok, b, c, d_ok, svt, svb, ACC)
            lse, q = _prefix(s, v, carry_l, carry_q, BLOCK_T, BLOCK_D)
            g = _rows(g_ptr, t, ok, b, c, d_ok, sgt, sgb, ACC) * out_scale
            _store_rows(grad_local_ptr, g * q, t, ok, b, c, d_ok, bsz * channels, channels)
            gamma = g * _rows(local_ptr, t, ok, b, c, d_ok, slt, slb, ACC)
            # a row whose prefix is padding only pools nothing usable: no gradient from it
            live = tl.max(lse, axis=1) > MASKED_SCORE / 2
            cc = -tl.sum(gamma * (q - mean[None, :]), axis=1)
            tl.store(c_ptr + row * length + t, tl.where(live, cc, 0.0), mask=ok)
            carry_l, carry_q = _last_row(lse, rows, BLOCK_T), _last_row(q, rows, BLOCK_T)
        tl.debug_barrier()  # the scratch row, written above, is read below by other threads
        _transposed_pooling(
            g_ptr, s_ptr, v_ptr, pad_ptr, local_ptr, lse_ptr, c_ptr, grad_s_ptr, grad_v_ptr,
            length, bsz, heads, channels, temperature, out_scale, sgt, sgb, sst, ssb, svt, svb,
            spb, spt, slt, slb, b, h, c, d_ok, row, mean, ACC, HAS_PAD, BLOCK_T, BLOCK_D,
        )  # fmt: skip


@triton.jit
def _transposed_pooling(
    g_ptr, s_ptr, v_ptr, pad_ptr, local_ptr, lse_ptr, c_ptr, grad_s_ptr, grad_v_ptr,
    length, bsz, heads, channels, temperature, out_scale, sgt, sgb, sst, ssb, svt, svb, spb,
    spt, slt, slb, b, h, c, d_ok, row, mean, ACC: tl.constexpr, HAS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The decoder's ``∂s`` and ``∂v``: ``Aᵀγ`` and ``Aᵀc`` backward in time, rows in
    reverse order, ``R_t = x_t + e^{L_t - L_{t+1}} R_{t+1}`` carried from block to block."""
    rows = tl.arange(0, BLOCK_T)
    carry_g = tl.zeros((BLOCK_D,), ACC)
    carry_c = tl.sum(tl.zeros((BLOCK_T,), ACC), axis=0)
    blocks = tl.cdiv(length, BLOCK_T)
    for k in range(0, blocks):
        t = (blocks - k) * BLOCK_T - 1 - rows  # latest first
        ok = t < length
        lse = tl.load(lse_ptr + row * length + t, mask=ok, other=0.0)
        later = t + 1 < length
        lse_next = tl.load(lse_ptr + row * length + t + 1, mask=later, other=0.0)
        a = tl.where(later, tl.exp(lse - lse_next), 0.0)  # the factor to the row after
        live = ok & (lse > MASKED_SCORE / 2)
        g = _rows(g_ptr, t, ok, b, c, d_ok, sgt, sgb, ACC) * out_scale
        gamma = tl.where(live[:, None], g * _rows(local_ptr, t, ok, b, c, d_ok, slt, slb, ACC), 0.0)
        cc = tl.load(c_ptr + row * length + t, mask=ok, other=0.0)
        a2 = tl.broadcast_to(a[:, None], (BLOCK_T, BLOCK_D))
        prod_g, rest_g = tl.associative_scan((a2, gamma), 0, _affine)
        prod_c, rest_c = tl.associative_scan((a, cc), 0, _affine)
        r_g = rest_g + prod_g * carry_g[None, :]
        r_c = rest_c + prod_c * carry_c
        s, keep = _scores(
            s_ptr, pad_ptr, t, ok, b, h, sst, ssb, spb, spt, temperature, HAS_PAD, ACC
        )
        v = _rows(v_ptr, t, ok, b, c, d_ok, svt, svb, ACC)
        share = tl.where(keep, tl.exp(s - lse), 0.0)  # e^{s_τ - L_τ}
        grad_v = share[:, None] * r_g
        grad_s = tl.sum((v - mean[None, :]) * grad_v, axis=1) + share * r_c
        tl.store(
            grad_s_ptr + t.to(tl.int64) * bsz * heads + b * heads + h,
            (grad_s / temperature).to(grad_s_ptr.dtype.element_ty),
            mask=ok,
        )
        _store_rows(grad_v_ptr, grad_v, t, ok, b, c, d_ok, bsz * channels, channels)
        carry_g, carry_c = _last_row(r_g, rows, BLOCK_T), _last(r_c, rows, BLOCK_T)


def _forward(
    u, weight, mask, scores, values, padding, heads, causal, temperature, scale, shift, dilation
):
    """Launch the forward kernel: ``(out, local, lse, soft, kernel)``, ``soft`` the weight's
    softmax (``C x F``) and ``kernel`` the taps' multipliers (``F x C``, the mask applied)."""
    length, bsz, channels = values.shape
    head_dim = channels // heads
    taps = weight.size(1)
    out = torch.empty(length, bsz, channels, dtype=values.dtype, device=values.device)
    local = torch.empty(length, bsz, channels, dtype=u.dtype, device=u.device)
    width = length if causal else head_dim + 1
    acc = torch.promote_types(values.dtype, torch.float32)
    lse = torch.empty(bsz, heads, width, dtype=acc, device=values.device)
    soft = torch.empty(channels, taps, dtype=acc, device=values.device)
    kernel = torch.empty(taps, channels, dtype=acc, device=values.device)
    pad = padding if padding is not None else scores
    if length and bsz:
        with _device_of(values):
            conv_heads_kernel[(bsz, heads)](
                scores, values, pad, local, out, lse, u, weight,
                mask if mask is not None else soft, soft, kernel,
                length, heads, head_dim, float(temperature), float(scale),
                *scores.stride()[:2], *values.stride()[:2], *pad.stride()[:2],
                *local.stride()[:2], *out.stride()[:2], *u.stride()[:2],
                shift, dilation, taps,
                CAUSAL=causal, ACC=_ACC[acc], HAS_PAD=padding is not None,
                HAS_MASK=mask is not None, BLOCK_T=BLOCK_T,
                BLOCK_D=triton.next_power_of_2(head_dim),
            )  # fmt: skip
    else:  # no program runs: the kernel's values in PyTorch, and nothing pooled
        lse.zero_()
        soft.copy_(torch.softmax(weight.to(acc), dim=-1))
        kernel.copy_((soft if mask is None else soft * mask).t())
    return out, local, lse, soft, kernel


def _backward(grad_out, local, scores, values, padding, lse, heads, causal, temperature, scale):
    """Launch the backward kernel: the gradients of ``local``, ``scores`` and ``values``."""
    grad_out = _channels_inner(grad_out)
    length, bsz, channels = values.shape
    head_dim = channels // heads
    grad_local = torch.empty(length, bsz, channels, dtype=local.dtype, device=local.device)
    grad_s = torch.empty(length, bsz, heads, dtype=scores.dtype, device=scores.device)
    grad_v = torch.empty(length, bsz, channels, dtype=values.dtype, device=values.device)
    scratch = torch.empty(
        bsz, heads, length if causal else 1, dtype=lse.dtype, device=values.device
    )
    pad = padding if padding is not None else scores
    if length and bsz:
        with _device_of(values):
            conv_heads_grad_kernel[(bsz, heads)](
                grad_out, scores, values, pad, local, lse, scratch, grad_local, grad_s, grad_v,
                length, bsz, heads, head_dim, temperature, scale,
                *grad_out.stride()[:2], *scores.stride()[:2], *values.stride()[:2],
                *pad.stride()[:2], *local.stride()[:2],
                CAUSAL=causal, ACC=_ACC[lse.dtype], HAS_PAD=padding is not None,
                BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(head_dim),
            )  # fmt: skip
    return grad_local, grad_s, grad_v


def _gradients(grad_out, kept, settings, need_u=True, need_weight=True):
    """``(∂u, ∂weight, ∂scores, ∂values)`` from what the forward pass kept (``u, soft,
    kernel, mask, local, scores, values, padding, lse``) and its ``settings`` (``heads,
    causal, temperature, scale, dilation, lookahead``, the weight's dtype)."""
    u, soft, kernel, mask, local, scores, values, padding, lse = kept
    heads, causal, temperature, scale, dilation, lookahead, weight_dtype = settings
    grad_local, grad_s, grad_v = _backward(
        grad_out, local, scores, values, padding, lse, heads, causal, temperature, scale
    )
    rows = padding.t().unsqueeze(-1) if padding is not None else None  # T x B x 1
    shift = (kernel.size(0) - 1) * dilation - lookahead
    grad_u, grad_kernel = conv_grads(
        grad_local, u, kernel, rows, shift, dilation, need_u, need_weight
    )
    grad_weight = None
    if grad_kernel is not None:  # F x C -> the weight's C x F, through the mask and softmax
        grad_soft = grad_kernel.t() if mask is None else mask * grad_kernel.t()
        # (in the kept precision: CUDA's kernel takes no other input dtype but float16)
        grad_weight = torch._softmax_backward_data(grad_soft, soft, 1, soft.dtype)
        grad_weight = grad_weight.to(weight_dtype)
    return grad_u, grad_weight, grad_s, grad_v


def _keep(ctx, inputs, output, weight_dtype):
    """Save what :func:`_gradients` takes from :class:`ConvHeads`'s ``inputs`` and the
    ``output`` of :func:`_conv_heads_forward`."""
    u, _, mask, scores, values, padding, *settings = inputs
    _, local, lse, soft, kernel = output
    ctx.save_for_backward(u, soft, kernel, mask, local, scores, values, padding, lse)
    ctx.settings = (*settings, weight_dtype)


class ConvHeads(torch.autograd.Function):
    """``scale · LocalConv(u) ⊙ Query(scores, values)`` (:func:`conv_heads`): forward one
    launch (LocalConv's rows kept, in ``u``'s dtype, for the backward pass, as the product
    would keep them; the kernel's softmax and the kernel, once each); backward the Query's
    kernel, then LocalConv's two
    (:class:`~tpp_plugin.modules.conv_heads_triton.TritonDilatedDepthwiseConv`'s), then
    the softmax's backward, from the kernel's gradient to the weight's."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _conv_heads_forward(*inputs)
        _keep(ctx, inputs, output, inputs[1].dtype)
        return output[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        grads = _gradients(grad_out, ctx.saved_tensors, ctx.settings, *ctx.needs_input_grad[:2])
        return grads[:2] + (None,) + grads[2:] + (None,) * 7


def _conv_heads_forward(
    u, weight, mask, scores, values, padding, heads, causal, temperature, scale, dilation, lookahead
):
    """``out`` and what the backward pass keeps: ``local, lse, soft, kernel``."""
    weight = weight.contiguous()  # (the kernels read C x F rows one after the other)
    mask = mask.contiguous() if mask is not None else None
    shift = (weight.size(1) - 1) * dilation - lookahead  # out[t] reads u[t - shift + k·δ]
    return _forward(
        u, weight, mask, scores, values, padding, heads, causal, temperature, scale, shift,
        dilation,
    )  # fmt: skip


# For torch.compile, the same as two operators, forward and backward, which its graphs
# call without tracing into them (eager training takes ConvHeads: less host time a call).
# LocalConv's dilation and lookahead come as a CPU tensor, ``geometry``: values a graph
# does not specialise on, so that layers of every width and dilation share one.


@torch.library.custom_op("tpp::conv_heads_forward", mutates_args=())
def conv_heads_forward(
    u: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    scores: Tensor,
    values: Tensor,
    padding: Optional[Tensor],
    heads: int,
    causal: bool,
    temperature: float,
    scale: float,
    geometry: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:class:`ConvHeads`'s forward: ``out, local, lse, soft, kernel``."""
    dilation, lookahead = geometry.tolist()
    return _conv_heads_forward(
        u, weight, mask, scores, values, padding, heads, causal, temperature, scale, dilation,
        lookahead,
    )  # fmt: skip


@conv_heads_forward.register_fake
def _(u, weight, mask, scores, values, padding, heads, causal, temperature, scale, geometry):
    length, bsz, channels = values.shape
    taps = weight.size(1)
    acc = torch.promote_types(values.dtype, torch.float32)
    width = length if causal else channels // heads + 1
    return (
        values.new_empty(length, bsz, channels),
        u.new_empty(length, bsz, channels),
        values.new_empty(bsz, heads, width, dtype=acc),
        values.new_empty(channels, taps, dtype=acc),
        values.new_empty(taps, channels, dtype=acc),
    )


@torch.library.custom_op("tpp::conv_heads_backward", mutates_args=())
def conv_heads_backward(
    grad_out: Tensor,
    u: Tensor,
    soft: Tensor,
    kernel: Tensor,
    mask: Optional[Tensor],
    local: Tensor,
    scores: Tensor,
    values: Tensor,
    padding: Optional[Tensor],
    lse: Tensor,
    geometry: Tensor,
    heads: int,
    causal: bool,
    temperature: float,
    scale: float,
    weight_dtype: torch.dtype,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:class:`ConvHeads`'s backward: ``(∂u, ∂weight, ∂scores, ∂values)``."""
    kept = (u, soft, kernel, mask, local, scores, values, padding, lse)
    settings = (heads, causal, temperature, scale, *geometry.tolist(), weight_dtype)
    return _gradients(grad_out, kept, settings)


@conv_heads_backward.register_fake
def _(grad_out, u, soft, kernel, mask, local, scores, values, padding, lse, geometry, *settings):
    length, bsz, channels = values.shape
    return (
        u.new_empty(u.shape),
        soft.new_empty(soft.shape, dtype=settings[-1]),
        scores.new_empty(length, bsz, settings[0]),
        values.new_empty(length, bsz, channels),
    )


def _setup_context(ctx, inputs, output):
    u, weight, mask, scores, values, padding, heads, causal, temperature, scale, geometry = inputs
    ctx.mark_non_differentiable(*output[1:])
    _, local, lse, soft, kernel = output
    ctx.save_for_backward(u, soft, kernel, mask, local, scores, values, padding, lse, geometry)
    ctx.settings = (heads, causal, temperature, scale, weight.dtype)


def _backward_op(ctx, grad_out, *unused):
    grads = conv_heads_backward(grad_out, *ctx.saved_tensors, *ctx.settings)
    return grads[:2] + (None,) + grads[2:] + (None,) * 6


conv_heads_forward.register_autograd(_backward_op, setup_context=_setup_context)


def conv_heads(
    u: Tensor,
    weight: Tensor,
    scores: Tensor,
    values: Tensor,
    padding: Optional[Tensor],
    heads: int,
    causal: bool,
    temperature: float,
    geometry: Union[Tuple[int, int], Tensor],
    mask: Optional[Tensor] = None,
    scale: float = 1.0,
) -> Tensor:
    """The conv heads' output ``scale · LocalConv(u) ⊙ q`` for a whole sequence: ``u`` and
    ``values`` ``T x B x C``; LocalConv's kernel the softmax over the taps of ``weight``
    (its ``C x F`` parameter), times DropConnect's ``mask`` (``C x F``) where given, and
    its ``geometry``, ``(dilation, lookahead)`` (:meth:`~tpp_plugin.modules.LocalConv.fused_parts`:
    two ints, or a CPU tensor of them, which torch.compile's graphs take as an input);
    ``scores`` ``T x B x H`` (channels innermost, any row strides: slices of the fused
    projection), ``padding`` ``B x T`` (True at padding) or None. Returns ``T x B x C``
    in the values' dtype; gradients for ``u``, ``weight``, ``scores`` and ``values``."""
    u, scores, values = (_channels_inner(x) for x in (u, scores, values))
    args = (
        u,
        weight,
        mask,
        scores,
        values,
        padding,
        heads,
        causal,
        float(temperature),
        float(scale),
    )
    if torch.compiler.is_compiling():
        if not isinstance(geometry, Tensor):
            geometry = torch.tensor(geometry)
        return conv_heads_forward(*args, geometry)[0]
    return ConvHeads.apply(
        *args, *(geometry.tolist() if isinstance(geometry, Tensor) else geometry)
    )


def _channels_inner(x: Tensor) -> Tensor:
    """``x`` itself where its last axis is contiguous (the kernels' only assumption), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
