"""Adaptive query module ("context Query") of a Transformer++ convolution-attention head.

Two projections of the input ``S`` (``T x d``), for each of the ``H_c`` conv heads:

.. math::

    v_t = S_t W^S + b^S \\in \\mathbb{R}^{d_h}, \\qquad
    s_t = S_t W^Q + b^Q \\in \\mathbb{R}

and the query is the softmax(over time)-weighted sum of the ``v_t``:

.. math::

    \\text{encoder:}\\quad q = \\sum_{\\tau} \\alpha_\\tau v_\\tau,\\quad
        \\alpha_\\tau = \\frac{e^{s_\\tau}}{\\sum_{\\tau'} e^{s_{\\tau'}}}
        \\quad(\\tau, \\tau' \\text{ over non-pad positions})

    \\text{decoder:}\\quad q_t = \\sum_{\\tau \\le t} \\alpha_{t,\\tau} v_\\tau,\\quad
        \\alpha_{t,\\tau} = \\frac{e^{s_\\tau}}{\\sum_{\\tau' \\le t} e^{s_{\\tau'}}}

i.e. a summary of the whole sentence (encoder), or of its prefix (decoder: a *prefix
softmax*, so that no position sees the future). The weights ``α`` are the head's
word-context weights; :meth:`ContextQuery.weights` returns them for visualisation.

The prefix softmax is an attention whose score depends on the key only, so in parallel
it is computed as ``scaled_dot_product_attention`` with a query of ones and a key of
``s`` (width 1, scale 1): stable (the kernel subtracts the row maximum) and fused.
Incremental decoding keeps the running triple ``(m, z, n)`` per head: the maximum
score so far, the normaliser ``Σ e^{s-m}`` and the numerator ``Σ e^{s-m} v`` (stored
together as one ``B x H x (2 + d_h)`` tensor), which makes a step ``O(d_h)`` whatever
the length decoded so far.
"""

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn


@with_incremental_state
class ContextQuery(nn.Module):
    """Softmax-pooled summary of a sequence, per head; prefix-causal when ``causal``.

    Args:
        input_dim: ``d``.
        num_heads: ``H_c``.
        head_dim: ``d_h``.
        causal: prefix softmax (decoder) instead of a sentence-wide one (encoder).
    """

    def __init__(self, input_dim: int, num_heads: int, head_dim: int, causal: bool):
        super().__init__()
        self.input_dim = input_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal = causal
        self.value_proj = nn.Linear(input_dim, num_heads * head_dim)  # W^S
        self.score_proj = nn.Linear(input_dim, num_heads)  # W^Q
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.score_proj.weight)
        nn.init.constant_(self.score_proj.bias, 0.0)

    def project(self, x: Tensor):
        """Scores ``B x H x T x 1`` and values ``B x H x T x d_h`` of ``x`` (``T x B x d``)."""
        return self.arrange(self.score_proj(x), self.value_proj(x))

    def arrange(self, scores: Tensor, values: Tensor):
        """``score_proj(x)`` (``T x B x H``) and ``value_proj(x)`` (``T x B x H·d_h``) as
        :meth:`project` returns them: ``B x H x T x 1`` and ``B x H x T x d_h``."""
        tgt_len, bsz, _ = values.shape
        values = values.reshape(tgt_len, bsz, self.num_heads, self.head_dim)
        return scores.permute(1, 2, 0).unsqueeze(-1), values.permute(1, 2, 0, 3)

    def forward(
        self,
        x: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """
        Args:
            x: ``T x B x d`` (the new positions only, in incremental decoding).
            padding_mask: ``B x T``, True at padding positions (excluded from the sum).
            incremental_state: fairseq's incremental state (causal mode only).

        Returns:
            the queries, ``B x H x T' x d_h``, where ``T' = 1`` for the sentence-wide
            query of the encoder and ``T' = T`` for the prefix queries of the decoder.
        """
        scores, values = self.project(x)
        return self.pool(scores, values, padding_mask, incremental_state)

    def pool(
        self,
        scores: Tensor,
        values: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tensor:
        """:meth:`forward` after the projections: ``scores`` and ``values`` as
        :meth:`project` (or :meth:`arrange`) returns them."""
        if incremental_state is not None:
            if not self.causal:
                raise RuntimeError("incremental decoding needs a causal ContextQuery")
            return self._step(scores, values, padding_mask, incremental_state)

        bsz, _, tgt_len, _ = scores.shape
        ones = scores.new_ones(bsz, self.num_heads, tgt_len if self.causal else 1, 1)
        mask = self._key_mask(padding_mask, tgt_len, scores.device)
        if mask is None and self.causal:
            return F.scaled_dot_product_attention(ones, scores, values, is_causal=True, scale=1.0)
        return F.scaled_dot_product_attention(ones, scores, values, attn_mask=mask, scale=1.0)

    def weights(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        """The word-context weights ``α``: ``B x H x T x T`` (row ``t`` is the
        distribution the query of position ``t`` pools with; in the encoder every row is
        the same sentence-wide distribution)."""
        scores, _ = self.project(x)
        tgt_len = scores.size(2)
        logits = scores.transpose(2, 3).expand(-1, -1, tgt_len, -1).float()
        mask = self._key_mask(padding_mask, tgt_len, scores.device)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return F.softmax(logits, dim=-1).type_as(scores)

    def _key_mask(
        self, padding_mask: Optional[Tensor], tgt_len: int, device: torch.device
    ) -> Optional[Tensor]:
        """Boolean mask (True = may be pooled), broadcastable to ``B x H x T x T``."""
        mask: Optional[Tensor] = None
        if padding_mask is not None:
            mask = ~padding_mask[:, None, None, :]
        if self.causal:
            causal = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=device).tril()
            if mask is None:
                return causal[None, None]
            # A padding row still pools its own position, so no softmax is ever empty
            # (its output is ignored anyway).
            diagonal = torch.eye(tgt_len, dtype=torch.bool, device=device)
            mask = (causal & mask) | diagonal
        return mask

    def _step(
        self,
        scores: Tensor,
        values: Tensor,
        padding_mask: Optional[Tensor],
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
    ) -> Tensor:
        """Running prefix softmax over the new positions, one at a time, in float32:
        ``m' = max(m, s)``, ``z' = z·e^{m-m'} + e^{s-m'}``, ``n' = n·e^{m-m'} + e^{s-m'}·v``,
        ``q = n'/z'``. Padding positions are left out of the running sums."""
        # the triple is kept in one B x H x (2 + d_h) tensor: one copy to reorder per step
        state = self._get_input_buffer(incremental_state).get("state")
        if state is None:
            bsz = scores.size(0)
            run_max = scores.new_full((bsz, self.num_heads, 1), torch.finfo(torch.float32).min, dtype=torch.float32)
            norm = torch.zeros_like(run_max)
            numer = scores.new_zeros(bsz, self.num_heads, self.head_dim, dtype=torch.float32)
        else:
            run_max, norm, numer = state[..., :1], state[..., 1:2], state[..., 2:]
        outputs = []
        for t in range(scores.size(2)):
            s = scores[:, :, t].float()  # B x H x 1
            if padding_mask is not None:
                s = s.masked_fill(padding_mask[:, t, None, None], float("-inf"))
            new_max = torch.maximum(run_max, s)
            decay = torch.exp(run_max - new_max)
            gain = torch.exp(s - new_max)
            norm = norm * decay + gain
            numer = numer * decay + gain * values[:, :, t].float()
            run_max = new_max
            # z >= 1 as soon as one real position was seen (its own term is e^0)
            outputs.append(torch.where(norm > 0, numer / norm, 0.0).type_as(values))
        self._set_input_buffer(
            incremental_state, {"state": torch.cat([run_max, norm, numer], dim=-1)}
        )
        if len(outputs) == 1:
            return outputs[0].unsqueeze(2)
        return torch.stack(outputs, dim=2)

    def reorder_incremental_state(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        new_order: Tensor,
    ):
        """Reorder the running state to follow beam search (this module's state only)."""
        state = self._get_input_buffer(incremental_state)
        if state:
            for key, value in state.items():
                if value is not None:
                    state[key] = value.index_select(0, new_order)
            self._set_input_buffer(incremental_state, state)

    def _get_input_buffer(
        self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
    ) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "context_query")
        return result if result is not None else {}

    def _set_input_buffer(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        state: Dict[str, Optional[Tensor]],
    ):
        return self.set_incremental_state(incremental_state, "context_query", state)

    def extra_repr(self) -> str:
        return (
            f"{self.input_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}"
        )
