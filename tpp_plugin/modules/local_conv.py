"""Adaptive sequence module ("LocalConv") of a Transformer++ convolution-attention head.

A depthwise-separable, dilated, causal 1-D convolution over time. For an input
``S`` of shape ``T x d`` and ``C`` output channels (``H_c`` heads of ``d_h`` channels):

.. math::

    U &= S W^P + b^P, \\qquad W^P \\in \\mathbb{R}^{d \\times C}
        \\quad\\text{(pointwise part)}

    A &= \\operatorname{softmax}_k(W^A), \\qquad W^A \\in \\mathbb{R}^{C \\times F}
        \\quad\\text{(one normalised kernel per channel)}

    \\operatorname{LocalConv}(S)_{t,c} &= \\sum_{k=0}^{F-1}
        \\tilde A_{c,k}\\; U_{t-(F-1-k)\\,\\delta,\\;c}

where ``F`` is the kernel width, ``δ`` the dilation and ``Ã`` is ``A`` after
DropConnect (dropout on the normalised kernel weights: in training, and in inference
under fairseq's ``--retain-dropout``, one mask per batch or search). The last tap
(``k = F-1``) weighs the current position; positions before the start of the sequence
and padding positions contribute zero. Because the weights are softmax-normalised,
each output is a weighted average of the ``F`` positions ``t, t-δ, ..., t-(F-1)δ``:
the paper's "local context of a word".

This module is the depthwise part (``W^A`` and the convolution); ``W^P`` is a slice of the
fused input projection of the owning :class:`~tpp_plugin.modules.HybridMultiheadAttention`
(as fairseq's ``LightweightConv1dTBC`` leaves its projection to the layer). The input is
fairseq's time-major ``T x B x C``; decoding keeps the last ``F·δ`` inputs in a ring, so a
step costs ``O(F·C)``. Triton kernels: :mod:`~tpp_plugin.modules.conv_heads_triton`.
"""

import contextlib
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

from . import conv_heads_triton
from .conv_heads_triton import zero_padding

#: the lags a compiled LocalConv covers, past and future positions (future ones only for
#: a centred one): those of the paper's widest layer, ``F = 15, δ = 2``, which every
#: narrower layer fits into, so that all share one compiled graph (:meth:`window_kernel`)
WINDOW = (28, 14)


class DilatedDepthwiseConv(torch.autograd.Function):
    """``out[t] = Σ_k kernel[k] ⊙ u[t + offset + a - (F-1-k)·δ]`` for ``t < out_len``, where
    indices outside ``u`` read zeros, ``offset = len(u) - out_len`` (the buffered history
    in front of the new positions) and ``a`` is the lookahead (0: causal).

    Shapes: ``u`` is ``L x B x C``, ``kernel`` is ``F x C``; the output is
    ``out_len x B x C`` in ``u``'s dtype. Sums are taken in float32 (or float64 for
    float64 input), also for half-precision input. ``padding`` (``L x B x 1``, True at
    padding positions) reads those rows of ``u`` as zeros: the masked copy is made
    again in the backward pass instead of being kept (``u`` itself, a slice of the
    layer's fused projection, is kept by the layer anyway)."""

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
        ctx.save_for_backward(u, kernel, padding)
        u = zero_padding(u, padding)
        reads = _tap_slices(
            kernel.size(0), dilation, u.size(0) - out_len + lookahead, out_len, u.size(0)
        )
        acc_dtype = torch.promote_types(u.dtype, torch.float32)
        kernel32 = kernel.to(acc_dtype)
        # a tap that every output row reads (the current position's, lag 0, in training)
        # starts the sum as a product: no zero-filled buffer and one pass less over it
        first = next((i for i, (_, dst, _) in enumerate(reads) if dst == slice(0, out_len)), None)
        if first is None:
            acc = torch.zeros(out_len, *u.shape[1:], dtype=acc_dtype, device=u.device)
        else:
            k, _, src = reads[first]
            acc = torch.mul(u[src], kernel32[k])  # promotes to float32
        for i, (k, dst, src) in enumerate(reads):
            if i != first:
                acc[dst].addcmul_(u[src], kernel32[k])
        ctx.dilation, ctx.out_len, ctx.lookahead = dilation, out_len, lookahead
        return acc.to(u.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        u, kernel, padding = ctx.saved_tensors
        u = zero_padding(u, padding)
        out_len = ctx.out_len
        reads = _tap_slices(
            kernel.size(0), ctx.dilation, u.size(0) - out_len + ctx.lookahead, out_len, u.size(0)
        )
        grad_u = grad_kernel = None
        acc_dtype = torch.promote_types(u.dtype, torch.float32)
        kernel32 = kernel.to(acc_dtype)
        # as in the forward pass: a tap that reaches every input row starts its gradient
        first = next((i for i, (_, _, src) in enumerate(reads) if src == slice(0, u.size(0))), None)
        if ctx.needs_input_grad[0]:
            if first is None:
                grad_u32 = torch.zeros(u.shape, dtype=acc_dtype, device=u.device)
            else:
                k, dst, _ = reads[first]
                grad_u32 = torch.mul(grad_out[dst], kernel32[k])  # promotes to float32
        if ctx.needs_input_grad[1]:
            grad_kernel32 = torch.zeros(kernel.shape, dtype=acc_dtype, device=kernel.device)
            # cast once, not once per tap: every tap's product reads it (a no-op in float32)
            grad_out32 = grad_out.to(acc_dtype)
        for i, (k, dst, src) in enumerate(reads):
            if ctx.needs_input_grad[0] and i != first:
                grad_u32[src].addcmul_(grad_out[dst], kernel32[k])
            if ctx.needs_input_grad[1]:
                # Σ over time and batch of grad ⊙ input, per channel, summed straight into
                # the kernel's gradient (u promoted to float32 by the product)
                # T' x B x C -> (T'·B) x C, summed into C
                torch.sum((grad_out32[dst] * u[src]).flatten(0, 1), dim=0, out=grad_kernel32[k])
        if ctx.needs_input_grad[0]:
            grad_u = zero_padding(grad_u32, padding).to(u.dtype)
        if ctx.needs_input_grad[1]:
            grad_kernel = grad_kernel32.to(kernel.dtype)
        return grad_u, grad_kernel, None, None, None, None


def shifted_taps(u: Tensor, kernel: Tensor, dilation: int, lookahead: int = 0) -> Tensor:
    """:class:`DilatedDepthwiseConv` of a whole sequence (``out_len = len(u)``, no history)
    in a form without branches on the sequence's length, for ``torch.compile``: one copy
    of ``u`` padded by constant widths, and the sum of ``F`` shifted slices of it, in
    float32 (float64 kept). Autograd differentiates it; ``u`` is ``T x B x C``, already
    masked, ``kernel`` ``F x C``."""
    taps, length = kernel.size(0), u.size(0)
    acc_dtype = torch.promote_types(u.dtype, torch.float32)
    # (F-1)·δ - a zeros in front, a behind: tap k of output t reads row t + k·δ
    padded = F.pad(u, (0, 0, 0, 0, (taps - 1) * dilation - lookahead, lookahead))
    kernel = kernel.to(acc_dtype)
    acc = padded[:length].to(acc_dtype) * kernel[0]  # T x B x C
    for k in range(1, taps):
        acc = acc + padded[k * dilation : k * dilation + length].to(acc_dtype) * kernel[k]
    return acc.to(u.dtype)


def _tap_slices(taps: int, dilation: int, offset: int, out_len: int, in_len: int):
    """``(k, output rows, input rows)`` of every tap ``k`` that reads any row: output
    ``t`` reads input ``t - lag`` with ``lag = (F-1-k)·δ - offset``."""
    reads = []
    for k in range(taps):
        lag = (taps - 1 - k) * dilation - offset
        if -in_len < lag < out_len:
            reads.append((k, *_overlap(lag, out_len, in_len)))
    return reads


def _overlap(lag: int, out_len: int, in_len: int):
    """The output rows ``t`` and input rows ``t - lag`` that both exist, as slices."""
    start = max(lag, 0)
    stop = min(out_len, in_len + lag)
    return slice(start, stop), slice(start - lag, stop - lag)


@with_incremental_state
class LocalConv(nn.Module):
    """Causal, dilated, softmax-normalised depthwise convolution of the pointwise
    projection ``U`` (``T x B x C``, fairseq's time-major layout).

    Args:
        channels: ``C``, the number of channels (all conv heads together).
        kernel_size: ``F``, the number of taps.
        dilation: ``δ``, the distance between taps.
        weight_dropout: DropConnect probability on the normalised kernel.
        centered: see :attr:`lookahead`.
        impl: ``"taps"`` (:class:`DilatedDepthwiseConv`, any device), ``"triton"``
            (:class:`~tpp_plugin.modules.conv_heads_triton.TritonDilatedDepthwiseConv`
            for CUDA tensors, the taps elsewhere), ``"fused"`` (``"triton"``, and the
            attention's whole conv heads in one kernel: :meth:`fused_parts`) or
            ``"auto"`` (Triton's where it is installed, for CUDA tensors); ``"taps"``
            where Triton is not installed.
        output_scale: a factor on every output (the attention's conv-head scale), folded
            into the float32 kernel: applied before anything is rounded to half
            precision, where the unscaled conv-head product might overflow.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        dilation: int = 1,
        weight_dropout: float = 0.0,
        centered: bool = False,
        impl: str = "auto",
        output_scale: float = 1.0,
    ):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.dilation = dilation
        #: the implementation, chosen once (:func:`~.conv_heads_triton.resolve`)
        self.impl = conv_heads_triton.resolve(impl)
        self.output_scale = output_scale
        #: positions ahead of ``t`` that output ``t`` sees: 0 (causal, the paper's) or,
        #: ``centered``, ``⌊(F-1)/2⌋·δ`` (taps ``t-⌈(F-1)/2⌉δ .. t+⌊(F-1)/2⌋δ``; encoder only)
        self.lookahead = ((kernel_size - 1) // 2) * dilation if centered else 0
        past = max(self.receptive_field - self.lookahead, WINDOW[0])
        #: (past, future) lags of :meth:`window_kernel`
        self.window = (past, max(self.lookahead, WINDOW[1]) if self.lookahead else 0)
        rows = [
            past - ((kernel_size - 1 - k) * dilation - self.lookahead) for k in range(kernel_size)
        ]
        self.register_buffer("window_rows", torch.tensor(rows), persistent=False)  # F: tap -> row
        #: :meth:`window_kernel` as :meth:`compiled_forward` built it
        self.built_kernel: Optional[Tensor] = None
        #: :meth:`fused_parts` as :meth:`compiled_forward` built them
        self.built_parts: Optional[tuple] = None
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))  # W^A
        self.weight_dropout_module = FairseqDropout(
            weight_dropout, module_name=self.__class__.__name__
        )
        self.reset_parameters()

    @property
    def drops_weights(self) -> bool:
        """Whether DropConnect applies now: in training, and in inference where fairseq's
        ``--retain-dropout`` keeps this module's dropout on (Monte-Carlo dropout)."""
        dropout = self.weight_dropout_module
        return dropout.p > 0 and (self.training or dropout.apply_during_inference)

    @property
    def receptive_field(self) -> int:
        """How many past positions (besides the current one) an output can see."""
        return (self.kernel_size - 1) * self.dilation

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.weight)

    def normalized_kernel(self) -> Tensor:
        """The kernel after softmax over taps and DropConnect, ``F x C``, in the precision
        of the convolution's sums from the softmax on (float32, float64 for a float64
        module): the taps are multiplied by it as it is, with no rounding to bf16/fp16.
        Computed from the current weight at every call: it is a ``C x F`` softmax, and
        fairseq's optimizers write parameters in place without telling anyone, so
        nothing derived from a weight may be kept between calls."""
        kernel = F.softmax(
            self.weight, dim=-1, dtype=torch.promote_types(self.weight.dtype, torch.float32)
        )
        if self.drops_weights:
            # DropConnect: drop individual (normalised) tap weights, not activations.
            kernel = self.weight_dropout_module(kernel)
        return kernel.t()  # C x F -> F x C

    def step(self, u: Tensor, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]) -> Tensor:
        """One decoding step, the module's only one (:meth:`forward` with an incremental
        state calls it for each new position): ``u`` is the new position's ``U`` (``B x
        C``); returns ``B x C`` **in float32** (the caller casts once, where it combines
        the heads). The new row goes into the ring (:meth:`ring`); the taps are a strided
        view of it, multiplied by the kernel in the order the ring holds them and summed.

        The ring holds the last ``F·δ`` positions, position ``p`` at row ``p mod F·δ``, so
        the taps of ``p`` (``p, p-δ, ..., p-(F-1)δ``) are the rows congruent to its row
        modulo ``δ``. Their order rotates with ``p``; :meth:`rotated_kernels` rotates the
        kernel to match, once per search (a search has its own incremental state, and no
        weight changes during one)."""
        if self.receptive_field == 0:  # F = 1: no ring, the one tap's weight
            return self._scaled(u * self.rotated_kernels(incremental_state)[0, 0])
        ring, row = self.ring(u, incremental_state)
        ring[row] = u
        # the taps are the rows j·δ + row mod δ (j < F): every δ-th row, all of them if δ = 1
        taps = ring[row % self.dilation :: self.dilation]  # F x B x C
        kernel = self.rotated_kernels(incremental_state)[
            row // self.dilation
        ]  # F x 1 x C, taps order
        return self._scaled((taps * kernel).sum(dim=0))  # B x C, float32

    def _scaled(self, out: Tensor) -> Tensor:
        return out * self.output_scale if self.output_scale != 1.0 else out

    def ring(
        self, u: Tensor, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]
    ) -> Tuple[Tensor, int]:
        """The decoding buffer as a ring of ``F·δ`` rows (``F·δ x B x C``: the last ``(F-1)·δ``
        positions that the taps read, and ``δ - 1`` older ones, so that every tap of a
        position lies on its row modulo ``δ``) and the row that the new position ``u``
        (``B x C``) is to be written to, which the caller writes; the state already points
        past it. (Kernel width 1 needs no ring.)"""
        rows = self.kernel_size * self.dilation
        buffer = self._get_input_buffer(incremental_state)
        if "ring" in buffer:
            ring, row = buffer["ring"], buffer["row"]
            if torch.is_grad_enabled() and u.requires_grad:
                ring = ring.clone()  # an earlier step's graph may hold the ring: no writing over it
        else:
            ring, row = u.new_zeros(rows, u.size(0), u.size(1)), 0
        buffer = dict(buffer, ring=ring, row=(row + 1) % rows)
        self._set_input_buffer(incremental_state, buffer)
        return ring, row

    def rotated_kernels(self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]]) -> Tensor:
        """``F x F x 1 x C`` (float32): entry ``a`` is the normalised kernel (``F x 1 x
        C``, shaped to broadcast over the batch) in the order in which the ring holds
        the taps of a position written at a row ``h`` with ``h // δ = a``. The taps' row
        ``j·δ + h mod δ`` holds the position ``((a - j) mod F)·δ`` steps back, which tap
        ``k = F-1 - (a - j) mod F`` weighs. Computed at the first call for an
        incremental state and kept in the module's buffer beside the ring (beam search
        does not reorder it: it is the same for every hypothesis), DropConnect's mask
        with it where :attr:`drops_weights`: one per search, as a whole sequence's
        forward draws one per batch."""
        buffer = self._get_input_buffer(incremental_state)
        if "kernels" in buffer:
            return buffer["kernels"]
        kernel = self.normalized_kernel()  # F x C
        size = self.kernel_size
        a = torch.arange(size, device=kernel.device)
        taps = size - 1 - (a[:, None] - a[None, :]) % size  # F x F: [a, j] -> k
        kernels = kernel[taps].unsqueeze(2)  # F x F x 1 x C
        self._set_input_buffer(incremental_state, dict(buffer, kernels=kernels))
        return kernels

    def forward(
        self,
        u: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """
        Args:
            u: the pointwise projection ``U`` of the input, ``T x B x C``.
            padding_mask: ``B x T``, True at padding positions (they contribute zero).
            incremental_state: fairseq's incremental state; when given, ``u`` holds the
                new positions only, decoded one after another by :meth:`step`.

        Returns:
            ``T x B x C``
        """
        padding = (
            padding_mask.transpose(0, 1).unsqueeze(-1) if padding_mask is not None else None
        )  # T x B x 1
        if incremental_state is not None:
            if self.lookahead:
                raise RuntimeError(
                    "a centred LocalConv sees the future: it cannot decode step by step"
                )
            u = zero_padding(u, padding)  # padding enters the buffer as zeros
            steps = [self.step(row, incremental_state) for row in u]  # T x (B x C), float32
            return torch.stack(steps).to(u.dtype)  # T x B x C
        if torch.compiler.is_compiling():  # one graph for every length and (F, δ) within WINDOW
            kernel = self.window_kernel() if self.built_kernel is None else self.built_kernel
            return shifted_taps(zero_padding(u, padding), kernel, 1, self.window[1])
        return self._convolution(u).apply(
            u, self.kernel(), self.dilation, u.size(0), self.lookahead, padding
        )

    def kernel(self) -> Tensor:
        """The kernel the convolution multiplies the taps by: :meth:`normalized_kernel`
        times the output scale, ``F x C``."""
        kernel = self.normalized_kernel()
        return kernel * self.output_scale if self.output_scale != 1.0 else kernel

    def dropconnect(self) -> Tuple[Optional[Tensor], float]:
        """:meth:`kernel` in parts, for kernels that compute the softmax themselves
        (:func:`~tpp_plugin.modules.query_triton.conv_heads`): DropConnect's ``C x F``
        mask (1 where a weight is kept, 0 where dropped; drawn afresh at every call where
        :attr:`drops_weights`, None otherwise) and the factor on the output (the output
        scale over the keeping probability). The same distribution as
        :meth:`normalized_kernel`'s DropConnect, drawn by its own operator."""
        if not self.drops_weights:
            return None, self.output_scale
        p = self.weight_dropout_module.p
        acc = torch.promote_types(self.weight.dtype, torch.float32)
        mask = torch.empty(self.weight.shape, dtype=acc, device=self.weight.device)
        return mask.bernoulli_(1 - p), self.output_scale / (1 - p)

    def window_kernel(self) -> Tensor:
        """:meth:`kernel` as one of dilation 1 over :attr:`window`'s lags, ``(past +
        future + 1) x C``: each tap at its lag's row, zeros elsewhere. Its shape and the
        code that builds it are the same for every layer within :data:`WINDOW` (the taps'
        rows are a tensor), which is what lets their compiled graphs be one."""
        kernel = self.kernel()
        rows = self.window[0] + self.window[1] + 1
        return kernel.new_zeros(rows, kernel.size(1)).index_copy(0, self.window_rows, kernel)

    @contextlib.contextmanager
    def compiled_forward(self):
        """:meth:`window_kernel`, built eagerly for the compiled forward inside
        (``tpp_fairseq.compiled``): the code that builds it depends on ``F`` and ``δ``
        and, traced, would make one graph per layer. Where the fused conv heads run, which
        build the kernel themselves, :meth:`fused_parts` instead."""
        if self.impl == "fused" and conv_heads_triton.runs("fused", self.weight):
            mask, scale = self.dropconnect()
            geometry = torch.tensor((self.dilation, self.lookahead))
            self.built_parts = (self.weight.view_as(self.weight), mask, scale, geometry)
        else:
            self.built_kernel = self.window_kernel()
        try:
            yield
        finally:
            self.built_kernel = self.built_parts = None

    def fused_parts(self) -> Tuple[Tensor, Optional[Tensor], float, Union[Tuple[int, int], Tensor]]:
        """What the fused conv heads take of this module
        (:func:`~tpp_plugin.modules.query_triton.conv_heads`): its weight, DropConnect's
        mask and the output's factor (:meth:`dropconnect`), and ``(δ, lookahead)``. Inside
        a compiled graph, as :meth:`compiled_forward` built them: the weight a view (a
        parameter's shape is a constant of the graph) and ``(δ, lookahead)`` a CPU tensor
        (whose values are not), so that layers of every width and dilation share one."""
        if self.built_parts is not None:
            return self.built_parts
        mask, scale = self.dropconnect()
        return self.weight, mask, scale, (self.dilation, self.lookahead)

    def _convolution(self, u: Tensor):
        """The autograd function that convolves ``u``: Triton's kernels where asked for
        and ``u`` can use them, else the taps."""
        if conv_heads_triton.runs(self.impl, u):
            return conv_heads_triton.TritonDilatedDepthwiseConv
        return DilatedDepthwiseConv

    def reorder_incremental_state(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        new_order: Tensor,
    ):
        """Reorder the buffered inputs to follow beam search (only this module's state;
        fairseq calls this method on every submodule itself)."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer.get("ring") is not None:
            buffer = dict(buffer, ring=buffer["ring"].index_select(1, new_order))
            self._set_input_buffer(incremental_state, buffer)

    def _get_input_buffer(
        self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
    ) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "local_conv")
        return result if result is not None else {}

    def _set_input_buffer(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        buffer: Dict[str, Optional[Tensor]],
    ):
        return self.set_incremental_state(incremental_state, "local_conv", buffer)

    def extra_repr(self) -> str:
        return (
            f"{self.channels}, kernel_size={self.kernel_size}, dilation={self.dilation}, "
            f"lookahead={self.lookahead}, weight_dropout={self.weight_dropout_module.p}, impl={self.impl}"
            + (f", output_scale={self.output_scale:.4g}" if self.output_scale != 1.0 else "")
        )
