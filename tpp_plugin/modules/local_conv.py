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
DropConnect (dropout on the normalised kernel weights, training only). The last tap
(``k = F-1``) weighs the current position; positions before the start of the sequence
and padding positions contribute zero. Because the weights are softmax-normalised,
each output is a weighted average of the ``F`` positions ``t, t-δ, ..., t-(F-1)δ``:
the paper's "local context of a word".

Incremental decoding keeps only the last ``(F-1)·δ`` pointwise outputs ``U``, so a
step costs ``O(F·C)`` whatever the length decoded so far, and any number of new
positions can be fed at once (the buffer and the new positions are convolved together).
"""

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn


@with_incremental_state
class LocalConv(nn.Module):
    """Pointwise projection followed by a causal, dilated, softmax-normalised depthwise
    convolution. Works on fairseq's ``T x B x d`` layout.

    Args:
        input_dim: ``d``, the width of the input.
        channels: ``C``, the number of output channels (all conv heads together).
        kernel_size: ``F``, the number of taps.
        dilation: ``δ``, the distance between taps.
        weight_dropout: DropConnect probability on the normalised kernel.
    """

    def __init__(
        self,
        input_dim: int,
        channels: int,
        kernel_size: int,
        dilation: int = 1,
        weight_dropout: float = 0.0,
    ):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        self.input_dim = input_dim
        self.channels = channels
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.pointwise = nn.Linear(input_dim, channels)
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.weight_dropout_module = FairseqDropout(
            weight_dropout, module_name=self.__class__.__name__
        )
        self.reset_parameters()

    @property
    def receptive_field(self) -> int:
        """How many past positions (besides the current one) an output can see."""
        return (self.kernel_size - 1) * self.dilation

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.pointwise.weight)
        nn.init.constant_(self.pointwise.bias, 0.0)
        nn.init.xavier_uniform_(self.weight)

    def normalized_kernel(self) -> Tensor:
        """The kernel after softmax over taps and DropConnect, shape ``F x C``."""
        if not (self.training or torch.is_grad_enabled()):
            # decoding asks once per step: keep it until the weight changes
            key = (self.weight.data_ptr(), self.weight._version, self.weight.dtype)
            cache = getattr(self, "_kernel_cache", None)
            if cache is None or cache[0] != key:
                cache = (key, F.softmax(self.weight.float(), dim=-1).type_as(self.weight).t())
                self._kernel_cache = cache
            return cache[1]
        kernel = F.softmax(self.weight.float(), dim=-1).type_as(self.weight)
        # DropConnect: drop individual (normalised) tap weights, not activations.
        kernel = self.weight_dropout_module(kernel)
        return kernel.t()

    def forward(
        self,
        x: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """
        Args:
            x: input ``T x B x d``.
            padding_mask: ``B x T``, True at padding positions (they contribute zero).
            incremental_state: fairseq's incremental state; when given, ``x`` holds the
                new positions only and the last ``(F-1)·δ`` inputs are taken from (and
                saved to) the state.

        Returns:
            ``T x B x C``
        """
        return self.convolve_projected(self.pointwise(x), padding_mask, incremental_state)

    def convolve_projected(
        self,
        u: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """:meth:`forward` after the pointwise projection: ``u`` is ``self.pointwise(x)``
        (``T x B x C``), e.g. computed by a caller that fuses it with other projections
        of the same input."""
        if padding_mask is not None:
            u = u.masked_fill(padding_mask.transpose(0, 1).unsqueeze(-1), 0.0)

        span = self.receptive_field
        if span > 0:
            history = None
            if incremental_state is not None:
                buffer = self._get_input_buffer(incremental_state)
                history = buffer.get("history")
            if history is None:
                history = u.new_zeros(span, u.size(1), u.size(2))
            u = torch.cat([history, u], dim=0)
            if incremental_state is not None:
                self._set_input_buffer(incremental_state, {"history": u[-span:]})

        return self._convolve(u, self.normalized_kernel(), out_len=u.size(0) - span)

    def _convolve(self, u: Tensor, kernel: Tensor, out_len: int) -> Tensor:
        """Causal dilated depthwise convolution of a left-padded ``u`` (``(span+T) x B x C``)
        with ``kernel`` (``F x C``). Done as a sum of shifted slices: on fairseq's
        time-major layout each slice is contiguous, no transposes are needed, and for
        the small widths used here it beats a grouped ``conv1d``."""
        if out_len == 1 and self.kernel_size > 1:
            # one position (a decoding step): its F taps are rows 0, δ, ..., (F-1)δ
            return (u[:: self.dilation] * kernel.unsqueeze(1)).sum(dim=0, keepdim=True)
        out = u[: out_len] * kernel[0]
        for k in range(1, self.kernel_size):
            start = k * self.dilation
            out = torch.addcmul(out, u[start : start + out_len], kernel[k])
        return out

    def reorder_incremental_state(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        new_order: Tensor,
    ):
        """Reorder the buffered inputs to follow beam search (only this module's state;
        fairseq calls this method on every submodule itself)."""
        buffer = self._get_input_buffer(incremental_state)
        history = buffer.get("history")
        if history is not None:
            buffer["history"] = history.index_select(1, new_order)
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
            f"{self.input_dim}, {self.channels}, kernel_size={self.kernel_size}, "
            f"dilation={self.dilation}, weight_dropout={self.weight_dropout_module.p}"
        )
