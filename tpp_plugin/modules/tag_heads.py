"""Token classifiers on the base encoder layers (Transformer++'s multi-task encoders).

For each tag type ``k`` (e.g. POS, NER) read after encoder layer ``l_k``:

.. math::

    p(y_t = c \\mid x) = \\operatorname{softmax}_c\\big(h^{(l_k)}_t W_k + b_k\\big)

where ``h^{(l)}`` is the output of encoder layer ``l`` (1-based). The heads return the
logits; the softmax and the cross-entropy are the criterion's job.
"""

from typing import Dict, List, Optional

from fairseq.models.transformer import Linear
from torch import Tensor, nn


class TagHeads(nn.Module):
    """One linear classifier per tag type, each reading its own encoder layer.

    Args:
        embed_dim: encoder width.
        tag_classes: number of classes per tag type (types missing here get no head).
        tag_layers: the 1-based encoder layer each tag type reads.
    """

    def __init__(self, embed_dim: int, tag_classes: Dict[str, int], tag_layers: Dict[str, int]):
        super().__init__()
        self.layers = {name: tag_layers[name] for name in tag_classes}
        self.heads = nn.ModuleDict(
            {name: Linear(embed_dim, classes) for name, classes in tag_classes.items()}
        )

    def __len__(self) -> int:
        return len(self.heads)

    def forward(
        self, encoder_states: List[Tensor], ran: Optional[List[int]] = None
    ) -> Dict[str, Tensor]:
        """``encoder_states``: the encoder's ``T x B x d`` states, embeddings first (as
        fairseq returns them with ``return_all_hiddens``); ``ran``: the 0-based layers
        whose states follow the embeddings when LayerDrop skipped some (None: all).
        Returns ``B x T x classes``."""
        if len(self.heads) and not encoder_states:
            raise RuntimeError(
                "tag heads need the encoder's hidden states (return_all_hiddens=True)"
            )
        if ran is not None and len(encoder_states) != len(ran) + 1:
            raise RuntimeError(
                f"{len(encoder_states)} encoder states for {len(ran)} layers run: the "
                "states of another pass of the encoder"
            )
        # the output of layer l: the state after the last layer run of the first l
        state = {
            name: layer if ran is None else sum(i < layer for i in ran)
            for name, layer in self.layers.items()
        }
        return {
            name: head(encoder_states[state[name]]).transpose(0, 1)  # T x B x K -> B x T x K
            for name, head in self.heads.items()
        }

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: layer {layer}" for name, layer in self.layers.items())
