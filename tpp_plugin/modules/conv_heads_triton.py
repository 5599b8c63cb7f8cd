"""The convolution heads as Triton kernels (``--conv-heads-impl triton``), for CUDA tensors:
LocalConv's convolution in one launch forward and two backward, and a decoding step of
the conv heads (LocalConv, Query and their product) in one launch.

**LocalConv's convolution**, :class:`~tpp_plugin.modules.local_conv.DilatedDepthwiseConv`'s
function with every tap summed in registers, in float32. Written in terms of one kernel,

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
  the forward's ``a`` and ``s``, as float32 partial sums that torch adds up.

Rows are fairseq's time-major ``(t, b)`` pairs, tiled ``BLOCK_R x BLOCK_C``, channels
innermost; any strides. **A decoding step** (:func:`conv_step`), one program per (sentence,
head), does what ``LocalConv.step``, ``ContextQuery.step`` and their product do, in
float32, on the modules' own states. ``TRITON_INTERPRET=1`` (set before Triton is
imported) runs the kernels on the CPU through Triton's interpreter, slowly: that is how
the tests check them on machines without a GPU.
"""

import contextlib
import functools
import logging
import os

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

logger = logging.getLogger(__name__)

#: the implementations of the conv heads (``--conv-heads-impl``): ``auto`` is these
#: kernels for CUDA tensors where Triton is installed, the taps elsewhere; ``fused`` is
#: these kernels and, for training, all of the conv heads in one forward launch
#: (:mod:`~tpp_plugin.modules.query_triton`)
IMPLS = ("auto", "taps", "triton", "fused")
MISSING = (
    "--conv-heads-impl {} needs Triton, which is not installed (pip install triton): the conv "
    "heads run as PyTorch operations (--conv-heads-impl taps), the same function"
)

#: rows (``(t, b)`` pairs) and channels per program: 8 elements per thread of 4 warps, a
#: tile whose register use stays moderate on sm_90.
BLOCK_R, BLOCK_C = 16, 64


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> Optional[str]:
    """Why Triton's interpreter cannot run these kernels here, or ``None``: before 3.7 it
    reads integer arguments as one-element arrays, which NumPy 2.4 does not convert to
    int (triton-lang/triton#9171), and cannot rewrite the decoding step's kernel."""
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 7):
        return None
    return (
        f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1) cannot run the conv "
        "heads' kernels: install triton>=3.7 to run them on the CPU, or use "
        "--conv-heads-impl taps"
    )


def usable_on(t: Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device and dtype."""
    return (t.is_cuda or interpreting()) and t.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )


def resolve(impl: str) -> str:
    """The implementation a module built with ``impl`` uses: ``impl`` itself, or
    ``"taps"`` where it asks for Triton and Triton is not installed (a model trained
    with the kernels, loaded where there are none: the same function, computed by PyTorch
    operations), with a warning once per process."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl in ("triton", "fused") and not available():
        _warn_missing(impl)
        return "taps"
    return impl


@functools.lru_cache(maxsize=None)
def _warn_missing(impl: str) -> None:
    logger.warning(MISSING.format(impl))


def runs(impl: str, t: Tensor, operator: bool = False) -> bool:
    """Whether implementation ``impl`` (as :func:`resolve` returned it) runs these
    kernels on ``t``: ``"triton"`` and ``"fused"`` on a tensor they can run on, ``"auto"``
    on a CUDA tensor where Triton is installed. Inside ``torch.compile`` only where the
    kernels are called as an ``operator`` (the fused conv heads' ``torch.library``
    operators; Triton's presence asked eagerly before, by
    ``LocalConv.compiled_forward``): elsewhere the PyTorch forms join the graphs."""
    if torch.compiler.is_compiling():
        return operator and impl == "fused" and usable_on(t)
    if impl == "auto":
        return t.is_cuda and usable_on(t) and available()
    return impl in ("triton", "fused") and usable_on(t)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels (built on first use, once per interpreter setting): the
    convolution's taps, its kernel's gradient, a decoding step."""
    return _taps_kernel(interpret), _kernel_grad_kernel(interpret), _conv_step_kernel(interpret)


# the integers that change with the batch's shape or at every decoding step are passed as
# they are: specialised (== 1, divisible by 16), each new class would be a compilation.
# Strides stay specialised: their divisibility lets loads be vectors.


@functools.lru_cache(maxsize=2)
def _taps_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["len_x", "len_y", "bsz", "a", "s", "taps"])
    def taps_kernel(
        x_ptr,
        y_ptr,
        k_ptr,
        len_x,
        len_y,
        bsz,
        channels,
        sxt,
        sxb,
        sxc,
        syt,
        syb,
        syc,
        skf,
        skc,
        a,
        s,
        taps,
        ACC: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        X_ALIGN: tl.constexpr,
        Y_ALIGN: tl.constexpr,
    ):
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
            x_row = src.to(tl.int64)[:, None] * sxt + b_off * sxb
            if X_ALIGN > 1:
                x_row = tl.multiple_of(x_row, [X_ALIGN, X_ALIGN])
            x = tl.load(x_ptr + x_row + c_off * sxc, mask=ok)
            acc += tl.where(ok, x.to(ACC), 0.0) * w[None, :]
        y_row = t.to(tl.int64)[:, None] * syt + b_off * syb
        if Y_ALIGN > 1:
            y_row = tl.multiple_of(y_row, [Y_ALIGN, Y_ALIGN])
        tl.store(
            y_ptr + y_row + c_off * syc,
            acc.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return taps_kernel


@functools.lru_cache(maxsize=2)
def _kernel_grad_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["len_g", "len_u", "bsz", "a", "s", "taps", "rows_per_program"])
    def kernel_grad_kernel(
        g_ptr,
        u_ptr,
        part_ptr,
        len_g,
        len_u,
        bsz,
        channels,
        sgt,
        sgb,
        sgc,
        sut,
        sub,
        suc,
        a,
        s,
        taps,
        rows_per_program,
        ACC: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        G_ALIGN: tl.constexpr,
        U_ALIGN: tl.constexpr,
    ):
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
            g_row = t.to(tl.int64)[:, None] * sgt + b_off * sgb
            u_row = src.to(tl.int64)[:, None] * sut + b_off * sub
            if G_ALIGN > 1:
                g_row = tl.multiple_of(g_row, [G_ALIGN, G_ALIGN])
            if U_ALIGN > 1:
                u_row = tl.multiple_of(u_row, [U_ALIGN, U_ALIGN])
            g = tl.load(g_ptr + g_row + c_off * sgc, mask=ok)
            x = tl.load(u_ptr + u_row + c_off * suc, mask=ok)
            acc += tl.where(ok, g.to(ACC) * x.to(ACC), 0.0)
        # partial sums: part[split, k, c]
        dst = part_ptr + (split * taps + k) * channels + cols
        tl.store(dst, tl.sum(acc, axis=0), mask=col_ok)

    return kernel_grad_kernel


@functools.lru_cache(maxsize=2)
def _conv_step_kernel(interpret: bool):
    import triton
    import triton.language as tl

    # head_row: the ring's row, a new one at every step
    @triton.jit(do_not_specialize=["head_row"])
    def conv_step_kernel(
        u_ptr,
        s_ptr,
        v_ptr,
        w_ptr,
        ring_ptr,
        row_ptr,
        state_ptr,
        new_state_ptr,
        out_ptr,
        head_row,
        ring_rows,
        heads,
        head_dim,
        taps,
        dilation,
        temperature,
        out_scale,
        su,
        ss,
        sv,
        swc,
        swf,
        srt,
        srb,
        so,
        HAS_STATE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)  # sentence (beam) row
        h = tl.program_id(1)  # conv head
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        c = (h * head_dim + d).to(tl.int64)  # the head's channels
        f = tl.arange(0, BLOCK_F)
        f_ok = f < taps
        u = tl.load(u_ptr + b * su + c, mask=d_ok)
        tl.store(row_ptr + b * srb + c, u, mask=d_ok)  # the ring's row head_row: the new position
        u = u.to(tl.float32)
        # the head's normalised kernel rows, softmax over taps: BLOCK_D x BLOCK_F
        both = d_ok[:, None] & f_ok[None, :]
        w = tl.load(w_ptr + c[:, None] * swc + f[None, :] * swf, mask=both)
        # (taps past F weigh nothing; channels past d_h get zeros and are never stored)
        w = tl.where(f_ok[None, :], tl.where(both, w.to(tl.float32), 0.0), float("-inf"))
        w = tl.exp(w - tl.max(w, axis=1)[:, None])
        kernel = w / tl.sum(w, axis=1)[:, None]
        # tap k reads the row written (F-1-k)·δ steps ago; the last tap is u itself
        rows = ((head_row - (taps - 1 - f) * dilation + ring_rows) % ring_rows).to(tl.int64)
        past = both & (f < taps - 1)[None, :]
        x = tl.load(ring_ptr + rows[None, :] * srt + b * srb + c[:, None], mask=past)
        x = tl.where(past, x.to(tl.float32), 0.0)
        x = tl.where((f == taps - 1)[None, :], u[:, None], x)
        local = tl.sum(kernel * x, axis=1)
        # the Query: merge the new position into the running (log-normaliser, mean)
        s = tl.load(s_ptr + b * ss + h).to(tl.float32) / temperature
        v = tl.load(v_ptr + b * sv + c, mask=d_ok).to(tl.float32)
        row = (b * heads + h) * (head_dim + 1)
        if HAS_STATE:
            prev_lse = tl.load(state_ptr + row)
            prev_q = tl.load(state_ptr + row + 1 + d, mask=d_ok)
            top = tl.maximum(prev_lse, s)
            lse = top + tl.log(tl.exp(prev_lse - top) + tl.exp(s - top))
            query = prev_q + tl.exp(s - lse) * (v - prev_q)
        else:
            lse = s
            query = v
        tl.store(new_state_ptr + row, lse)
        tl.store(new_state_ptr + row + 1 + d, query, mask=d_ok)
        out = local * query * out_scale
        tl.store(out_ptr + b * so + c, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return conv_step_kernel


def _acc_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _taps(x: Tensor, kernel: Tensor, out_len: int, a: int, s: int) -> Tensor:
    """``y[t] = Σ_k kernel[k] ⊙ x[t - (a + k·s)]`` for ``t < out_len``, in ``x``'s dtype."""
    import triton

    taps_kernel = _kernels(interpreting())[0]
    bsz, channels = x.size(1), x.size(2)
    y = x.new_empty(out_len, bsz, channels)
    if y.numel() == 0:
        return y
    grid = (triton.cdiv(out_len * bsz, BLOCK_R), triton.cdiv(channels, BLOCK_C))
    with _device_of(x):
        taps_kernel[grid](
            x,
            y,
            kernel,
            x.size(0),
            out_len,
            bsz,
            channels,
            *x.stride(),
            *y.stride(),
            *kernel.stride(),
            a,
            s,
            kernel.size(0),
            ACC=_acc_dtype(x.dtype),
            BLOCK_R=BLOCK_R,
            BLOCK_C=BLOCK_C,
            X_ALIGN=_row_align(x),
            Y_ALIGN=_row_align(y),
        )
    return y


def _row_align(t: Tensor) -> int:
    """How many elements every ``(t, b)`` row offset of ``t`` (``T x B x C``) is a multiple
    of, with the address: 16 bytes' worth where its strides and address allow, else 1.
    A kernel hint: Triton sees a stride as aligned only when it is divisible by 16, and
    ``u``'s row stride (the fused projection's width) is 8 mod 16, so its loads would
    stay scalar. Never more than is true: a false hint reads wrong or faults."""
    align = 16 // t.element_size()
    if t.stride(0) % align == 0 and t.stride(1) % align == 0 and t.data_ptr() % 16 == 0:
        return align
    return 1


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _device_of(t: Tensor):
    """Launches on ``t``'s GPU (Triton launches on the current one); no device switch
    where it is the current one already. A CPU tensor goes to Triton's interpreter,
    refused with the reason where it cannot run the kernels."""
    if not t.is_cuda:
        problem = interpreter_problem()
        if problem:
            raise RuntimeError(problem)
    elif t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _kernel_grad(
    grad_out: Tensor, u: Tensor, taps: int, a: int, s: int, programs: Optional[int] = None
) -> Tensor:
    """``Σ_{t,b} grad_out[t] ⊙ u[t - (a + k·s)]`` for every tap ``k``: ``F x C`` in float32
    (float64 for float64 input). The rows are split among about ``programs`` programs
    (default: four per multiprocessor), whose partial sums are added here."""
    import triton

    kernel_grad_kernel = _kernels(interpreting())[1]
    out_len, bsz, channels = grad_out.shape
    acc_dtype = torch.promote_types(u.dtype, torch.float32)
    rows = out_len * bsz
    row_blocks = max(1, triton.cdiv(rows, BLOCK_R))
    col_blocks = triton.cdiv(channels, BLOCK_C)
    # enough programs to fill the device (a few per multiprocessor), each over whole row blocks
    if programs is None:
        programs = 4 * (_multiprocessors(u.device) if u.is_cuda else 1)
    splits = min(row_blocks, max(1, triton.cdiv(programs, taps * col_blocks)))
    rows_per_program = triton.cdiv(row_blocks, splits) * BLOCK_R
    splits = triton.cdiv(rows, rows_per_program) if rows else 1
    part = torch.zeros(splits, taps, channels, dtype=acc_dtype, device=u.device)
    if rows:
        with _device_of(u):
            kernel_grad_kernel[(taps, col_blocks, splits)](
                grad_out,
                u,
                part,
                out_len,
                u.size(0),
                bsz,
                channels,
                *grad_out.stride(),
                *u.stride(),
                a,
                s,
                taps,
                rows_per_program,
                ACC=_acc_dtype(u.dtype),
                BLOCK_R=BLOCK_R,
                BLOCK_C=BLOCK_C,
                G_ALIGN=_row_align(grad_out),
                U_ALIGN=_row_align(u),
            )
    return part.sum(0)


def zero_padding(x: Tensor, padding: Optional[Tensor]) -> Tensor:
    """``x`` with the rows of ``padding`` (True) set to zero (``x`` itself without one)."""
    return x if padding is None else x.masked_fill(padding, 0.0)


class TritonDilatedDepthwiseConv(torch.autograd.Function):
    """:class:`~tpp_plugin.modules.local_conv.DilatedDepthwiseConv` (same arguments, same
    result) as Triton kernels."""

    @staticmethod
    def forward(
        ctx,
        u: Tensor,
        kernel: Tensor,
        dilation: int,
        out_len: int,
        lookahead: int = 0,
        padding: Optional[Tensor] = None,
    ) -> Tensor:
        taps = kernel.size(0)
        a = (taps - 1) * dilation - (u.size(0) - out_len + lookahead)  # out[t] reads u[t - a + k·δ]
        # F x C with channels contiguous (LocalConv's is a transposed view): vector loads of the taps
        kernel = kernel.contiguous()
        ctx.save_for_backward(u, kernel, padding)
        ctx.a, ctx.dilation = a, dilation
        return _taps(zero_padding(u, padding), kernel, out_len, a, -dilation)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        u, kernel, padding = ctx.saved_tensors
        grad_u, grad_kernel = conv_grads(
            grad_out, u, kernel, padding, ctx.a, ctx.dilation, *ctx.needs_input_grad[:2]
        )
        return grad_u, grad_kernel, None, None, None, None


def conv_grads(
    grad_out: Tensor,
    u: Tensor,
    kernel: Tensor,
    padding: Optional[Tensor],
    a: int,
    dilation: int,
    need_u: bool = True,
    need_kernel: bool = True,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The gradients of ``u`` and of the kernel of ``out[t] = Σ_k kernel[k] ⊙ u[t - a + k·δ]``
    (``padding``, ``L x B x 1``: rows of ``u`` read as zero), each where asked for."""
    grad_u = grad_kernel = None
    if need_u:
        # ∂u[j] = Σ_k K[k] ∂out[j + a - k·δ]: the forward kernel with the taps mirrored
        grad_u = zero_padding(_taps(grad_out, kernel, u.size(0), -a, dilation), padding)
    if need_kernel:
        grad_kernel = _kernel_grad(
            grad_out, zero_padding(u, padding), kernel.size(0), a, -dilation
        ).to(kernel.dtype)
    return grad_u, grad_kernel


def conv_step(
    u: Tensor,
    scores: Tensor,
    values: Tensor,
    weight: Tensor,
    ring: Tensor,
    head_row: int,
    state: Optional[Tensor],
    dilation: int,
    temperature: float,
    out_scale: float,
    out: Optional[Tensor] = None,
    check: bool = True,
) -> Tuple[Tensor, Tensor]:
    """One decoding step of the conv heads: ``u`` and ``values`` ``B x C``, ``scores``
    ``B x H_c`` (rows of the fused projection: channels contiguous), ``weight`` LocalConv's
    ``C x F`` (before the softmax), ``ring`` its ``F·δ x B x C`` ring (``LocalConv.ring``), whose row
    ``head_row`` receives ``u``, and ``state`` the Query's ``B x H_c x (1 + d_h)`` float32
    state (None at the first step). Returns ``LocalConv ⊙ Query · out_scale`` (``B x C``,
    in ``u``'s dtype; written into ``out`` if given: ``B x C``, rows of any stride) and the
    Query's new state.

    ``check``: the shapes, strides, devices and dtype are checked first (a wrong shape
    would read out of bounds on a GPU, where nothing checks it). The hybrid attention,
    whose states have these shapes by construction, skips it: beam search calls this once
    per layer and output token, and the checks are host time."""
    import triton

    conv_step_kernel = _kernels(interpreting())[2]
    bsz, channels = u.shape
    heads = scores.size(1)
    head_dim = channels // heads
    taps = weight.size(1)
    if check:
        _check_step_arguments(u, scores, values, weight, ring, head_row, state, dilation, out)
    if out is None:
        out = torch.empty_like(u, memory_format=torch.contiguous_format)
    new_state = torch.empty(bsz, heads, head_dim + 1, dtype=torch.float32, device=u.device)
    if state is not None and not state.is_contiguous():
        state = state.contiguous()
    with _device_of(u):
        conv_step_kernel[(bsz, heads)](
            u,
            scores,
            values,
            weight,
            ring,
            ring[head_row],
            new_state if state is None else state,
            new_state,
            out,
            head_row,
            ring.size(0),
            heads,
            head_dim,
            taps,
            dilation,
            float(temperature),
            float(out_scale),
            u.stride(0),
            scores.stride(0),
            values.stride(0),
            *weight.stride(),
            ring.stride(0),
            ring.stride(1),
            out.stride(0),
            HAS_STATE=state is not None,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_F=triton.next_power_of_2(taps),
        )
    return out, new_state


def _check_step_arguments(
    u: Tensor,
    scores: Tensor,
    values: Tensor,
    weight: Tensor,
    ring: Tensor,
    head_row: int,
    state: Optional[Tensor],
    dilation: int,
    out: Optional[Tensor],
) -> None:
    """:func:`conv_step`'s arguments agree with each other (a ``ValueError`` naming the
    first that does not)."""
    bsz, channels = u.shape
    heads = scores.size(1)
    head_dim = channels // heads
    taps = weight.size(1)
    expected = {
        "scores": (bsz, heads),
        "values": (bsz, channels),
        "weight": (channels, taps),
        "ring": (taps * dilation, bsz, channels),
        "state": (bsz, heads, head_dim + 1),
    }
    if state is not None and state.dtype != torch.float32:
        raise ValueError(f"conv_step: the Query's state must be float32, not {state.dtype}")
    if out is not None:
        expected["out"] = (bsz, channels)
    for name, t in (
        ("u", u),
        ("scores", scores),
        ("values", values),
        ("weight", weight),
        ("ring", ring),
        ("state", state),
        ("out", out),
    ):
        if t is None:
            continue
        if name in expected and tuple(t.shape) != expected[name]:
            raise ValueError(f"conv_step: {name} is {tuple(t.shape)}, expected {expected[name]}")
        if t.stride(-1) != 1 or t.device != u.device:
            raise ValueError(
                f"conv_step: {name} must be on {u.device} and contiguous along its last axis"
            )
    if channels != heads * head_dim or not 0 <= head_row < ring.size(0):
        raise ValueError(
            f"conv_step: {channels} channels, {heads} heads, ring row {head_row} of {ring.size(0)}"
        )
