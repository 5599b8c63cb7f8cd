"""LocalConv's convolution as Triton kernels: one launch forward, two backward.

The same function as :class:`~tpp_plugin.modules.local_conv.DilatedDepthwiseConv`, whose
loop over the ``F`` taps launches one element-wise kernel per tap forward and three per
tap backward (41 taps per stack with the paper's widths 3, 5, 7, 11, 15), each reading
and writing a float32 buffer of the whole ``T x B x C`` activation. Here every tap is
summed in registers, in float32, and each output is written once. Written in terms of
one kernel,

.. math::

    y_{t,b,c} = \\sum_{k=0}^{F-1} K_{k,c}\\; x_{t - (a + k s),\\,b,\\,c}
    \\qquad (x \\text{ read as zero outside } 0 \\dots L_x - 1)

the three products of the autograd function are

* forward, ``out = conv(u)``: ``x = u``, ``a = (F-1)δ - o``, ``s = -δ``, where
  ``o = len(u) - out_len + lookahead`` (the buffered history in front of the new
  positions, and the lookahead of a centred kernel);
* the input's gradient: the same kernel with the taps mirrored, ``x = ∂out``,
  ``y = ∂u``, ``a = o - (F-1)δ``, ``s = +δ``;
* the kernel's gradient, ``∂K_{k,c} = Σ_{t,b} ∂out_{t,b,c} · u_{t - (a + k s),b,c}`` with
  the forward's ``a`` and ``s``: one program per tap, channel block and block of rows,
  whose float32 partial sums torch adds up.

Rows are fairseq's time-major ``(t, b)`` pairs, tiled ``BLOCK_R x BLOCK_C`` with
channels innermost, so every load and store is contiguous along channels; any strides
are accepted (``u`` is a slice of the attention's fused input projection).

Tensors on a CUDA device only. ``TRITON_INTERPRET=1`` (set before this module builds
its kernels) runs the same kernels on the CPU through Triton's interpreter, slowly:
that is how the tests check them on machines without a GPU.
"""

import functools
import os

import torch
from torch import Tensor

#: rows (``(t, b)`` pairs) and channels per program: 8 elements per thread of 4 warps,
#: 72-80 registers per thread for sm_90 (ptxas; 32 x 64 took 145-159). Not timed on a GPU yet.
BLOCK_R, BLOCK_C = 16, 64


def available() -> bool:
    """Whether Triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable_on(t: Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device and dtype."""
    return (t.is_cuda or interpreting()) and t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels (built on first use, once per interpreter setting)."""
    import triton
    import triton.language as tl

    @triton.jit
    def taps_kernel(x_ptr, y_ptr, k_ptr, len_x, len_y, bsz, channels,
                    sxt, sxb, sxc, syt, syb, syc, skf, skc, a, s, taps,
                    ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (t, b) pairs
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t, b = rows // bsz, rows % bsz
        row_ok = rows < len_y * bsz
        col_ok = cols < channels
        b_off = b.to(tl.int64)[:, None]
        c_off = cols.to(tl.int64)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for k in range(taps):
            src = t - (a + k * s)
            ok = (row_ok & (src >= 0) & (src < len_x))[:, None] & col_ok[None, :]
            w = tl.load(k_ptr + k * skf + cols * skc, mask=col_ok).to(ACC)
            x = tl.load(x_ptr + src.to(tl.int64)[:, None] * sxt + b_off * sxb + c_off * sxc, mask=ok)
            acc += tl.where(ok, x.to(ACC), 0.0) * w[None, :]
        out = y_ptr + t.to(tl.int64)[:, None] * syt + b_off * syb + c_off * syc
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def kernel_grad_kernel(g_ptr, u_ptr, part_ptr, len_g, len_u, bsz, channels,
                           sgt, sgb, sgc, sut, sub, suc, a, s, taps, rows_per_program,
                           ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        k = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        split = tl.program_id(2)
        col_ok = cols < channels
        c_off = cols.to(tl.int64)[None, :]
        lag = a + k * s
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        first = split * rows_per_program
        for start in range(first, first + rows_per_program, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            t, b = rows // bsz, rows % bsz
            src = t - lag
            ok = ((rows < len_g * bsz) & (src >= 0) & (src < len_u))[:, None] & col_ok[None, :]
            b_off = b.to(tl.int64)[:, None]
            g = tl.load(g_ptr + t.to(tl.int64)[:, None] * sgt + b_off * sgb + c_off * sgc, mask=ok)
            x = tl.load(u_ptr + src.to(tl.int64)[:, None] * sut + b_off * sub + c_off * suc, mask=ok)
            acc += tl.where(ok, g.to(ACC) * x.to(ACC), 0.0)
        # partial sums: part[split, k, c]
        dst = part_ptr + (split * taps + k) * channels + cols
        tl.store(dst, tl.sum(acc, axis=0), mask=col_ok)

    return taps_kernel, kernel_grad_kernel


def _acc_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _taps(x: Tensor, kernel: Tensor, out_len: int, a: int, s: int) -> Tensor:
    """``y[t] = Σ_k kernel[k] ⊙ x[t - (a + k·s)]`` for ``t < out_len``, in ``x``'s dtype."""
    import triton

    taps_kernel, _ = _kernels(interpreting())
    bsz, channels = x.size(1), x.size(2)
    y = x.new_empty(out_len, bsz, channels)
    if y.numel() == 0:
        return y
    grid = (triton.cdiv(out_len * bsz, BLOCK_R), triton.cdiv(channels, BLOCK_C))
    taps_kernel[grid](x, y, kernel, x.size(0), out_len, bsz, channels, *x.stride(), *y.stride(), *kernel.stride(),
                      a, s, kernel.size(0), ACC=_acc_dtype(x.dtype), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return y


def _kernel_grad(grad_out: Tensor, u: Tensor, taps: int, a: int, s: int) -> Tensor:
    """``Σ_{t,b} grad_out[t] ⊙ u[t - (a + k·s)]`` for every tap ``k``: ``F x C`` in float32
    (float64 for float64 input)."""
    import triton

    _, kernel_grad_kernel = _kernels(interpreting())
    out_len, bsz, channels = grad_out.shape
    acc_dtype = torch.promote_types(u.dtype, torch.float32)
    rows = out_len * bsz
    row_blocks = max(1, triton.cdiv(rows, BLOCK_R))
    col_blocks = triton.cdiv(channels, BLOCK_C)
    # enough programs to fill the device (a few per multiprocessor), each over whole row blocks
    programs = 4 * (torch.cuda.get_device_properties(u.device).multi_processor_count if u.is_cuda else 1)
    splits = min(row_blocks, max(1, triton.cdiv(programs, taps * col_blocks)))
    rows_per_program = triton.cdiv(row_blocks, splits) * BLOCK_R
    splits = triton.cdiv(rows, rows_per_program) if rows else 1
    part = torch.zeros(splits, taps, channels, dtype=acc_dtype, device=u.device)
    if rows:
        kernel_grad_kernel[(taps, col_blocks, splits)](
            grad_out, u, part, out_len, u.size(0), bsz, channels, *grad_out.stride(), *u.stride(),
            a, s, taps, rows_per_program, ACC=_acc_dtype(u.dtype), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return part.sum(0)


class TritonDilatedDepthwiseConv(torch.autograd.Function):
    """:class:`~tpp_plugin.modules.local_conv.DilatedDepthwiseConv` (same arguments, same
    result) as Triton kernels."""

    @staticmethod
    def forward(ctx, u: Tensor, kernel: Tensor, dilation: int, out_len: int, lookahead: int = 0) -> Tensor:
        taps = kernel.size(0)
        a = (taps - 1) * dilation - (u.size(0) - out_len + lookahead)  # out[t] reads u[t - a + k·δ]
        ctx.save_for_backward(u, kernel)
        ctx.a, ctx.dilation = a, dilation
        return _taps(u, kernel, out_len, a, -dilation)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        u, kernel = ctx.saved_tensors
        a, dilation = ctx.a, ctx.dilation
        grad_u = grad_kernel = None
        if ctx.needs_input_grad[0]:
            # ∂u[j] = Σ_k K[k] ∂out[j + a - k·δ]: the forward kernel with the taps mirrored
            grad_u = _taps(grad_out, kernel, u.size(0), -a, dilation)
        if ctx.needs_input_grad[1]:
            grad_kernel = _kernel_grad(grad_out, u, kernel.size(0), a, -dilation).to(kernel.dtype)
        return grad_u, grad_kernel, None, None, None
