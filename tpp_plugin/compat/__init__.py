"""What the plugin changes in the fairseq and torch it runs on, applied by :func:`apply`
when the plugin is imported (fairseq's tools import ``--user-dir`` before they parse the
rest of the command line, build a model or load a checkpoint):

- :mod:`.fixes` and :mod:`.checkpoints`: corrections, always on (docs/fairseq_notes.md
  lists each with the fairseq behaviour it answers);
- :mod:`.speed`: speed-ups of fairseq's training loop on GPUs, chosen by
  ``TPP_FAIRSEQ_SPEEDUPS`` (default: those a GPU figure shows to pay).

Each change logs once, at the first moment it changes something. A tool that needs one
of them calls it (they are idempotent), e.g. :func:`allow_fairseq_checkpoints`.
"""

from . import checkpoints, fixes, speed
from .fixes import allow_fairseq_checkpoints  # noqa: F401  (for tools that load checkpoints)


def apply(root_level_before_fairseq=None) -> None:
    """All of the corrections and the chosen speed-ups (idempotent); the logging level
    first, so that the others' messages are filtered by it."""
    fixes.undo_debug_logging_of_fairseq_import(root_level_before_fairseq)
    fixes.allow_fairseq_checkpoints()
    fixes.keep_last_batches()
    fixes.bf16_without_tpu()
    fixes.one_line_errors()
    checkpoints.checkpoints_that_know_their_data()
    speed.install(speed.chosen())
