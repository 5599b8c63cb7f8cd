"""Transformer++ for fairseq: load with ``--user-dir tpp_plugin``.

Registers the ``transformer_pp`` model family (and its presets), the
``translation_with_tags`` task and the ``label_smoothed_cross_entropy_with_tags``
criterion, allow-lists fairseq's checkpoint contents for torch's safe loading, and
restores upstream fairseq's batching of the last, incomplete batch (see
:mod:`tpp_plugin.fairseq_fixes`).
"""

from .fairseq_fixes import bf16_without_tpu, keep_last_batches
from .serialization import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
keep_last_batches()
bf16_without_tpu()

from . import criterions, models, tasks  # noqa: E402,F401  (registration side effects)

__version__ = "0.1.0"
