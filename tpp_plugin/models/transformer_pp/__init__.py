"""``transformer_pp``: options (:mod:`.config`), layers (:mod:`.layers`), the model
(:mod:`.model`) and its ``--arch`` presets (:mod:`.presets`)."""

from .config import PAPER_KERNEL_SIZES, ConvHeadsConfig  # noqa: F401
from .model import TransformerPPDecoder, TransformerPPEncoder, TransformerPPModel  # noqa: F401
from .presets import transformer_pp_base_architecture  # noqa: F401  (registers the presets)
