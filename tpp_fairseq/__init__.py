"""What the project changes in the fairseq and torch it runs on, kept apart from the
model (:mod:`tpp_plugin`), which applies it all by :func:`apply` when it is loaded
(fairseq's tools import ``--user-dir`` before they parse the rest of the command line,
build a model or load a checkpoint). Importing this package changes nothing.

- :mod:`.fixes`' and :mod:`.epochs`' corrections of fairseq 0.12 on today's torch and
  Python, and :func:`.speed.states_of_either_layout`, always on (docs/fairseq_notes.md
  lists each with the fairseq behaviour it answers);
- :data:`CHECKS`, what the plugin adds to every fairseq command that loads it
  (:mod:`.checkpoints`: checkpoints that know their data; :mod:`.errors`: one-line
  errors; :mod:`.data_files`: binarized files checked before fairseq reads them),
  chosen by ``TPP_FAIRSEQ_CHECKS`` (default: :data:`DEFAULT_CHECKS`; the project's
  ``tpp-train`` asks for all);
- :mod:`.speed`: speed-ups of fairseq's training loop on GPUs, chosen by
  ``TPP_FAIRSEQ_SPEEDUPS`` (default: those a GPU figure shows to pay).

Each change logs once, at the first moment it changes something. A tool that needs one
of them, and only that one, calls it (they are idempotent), e.g.
:func:`allow_fairseq_checkpoints`.
"""

from . import _log, checkpoints, data_files, epochs, errors, fixes, speed
from ._switch import SwitchError, chosen
from .fixes import allow_fairseq_checkpoints  # noqa: F401  (for tools that load checkpoints)

#: name -> installer; ``TPP_FAIRSEQ_CHECKS`` (``all``, ``none`` or names separated by
#: commas) chooses
CHECKS = {
    "checkpoints": checkpoints.checkpoints_that_know_their_data,
    "record-every-task": checkpoints.record_every_task,
    "one-line-errors": fixes.one_line_errors,
    "data-files": data_files.check_every_data_file,
}
#: the checks of a fairseq command that loads the plugin: the checks of the checkpoints
#: that carry a record (the plugin's task writes one), the one-line errors and the
#: binarized files' checks
DEFAULT_CHECKS = ("checkpoints", "one-line-errors", "data-files")


#: the fairseq the changes are written against (its functions' names and signatures)
FAIRSEQ_SERIES = "0.12."


def check_fairseq_version() -> None:
    """Warn once where the fairseq found is not of :data:`FAIRSEQ_SERIES`: each change
    replaces a function of that fairseq and may not fit another."""
    import fairseq

    version = getattr(fairseq, "__version__", "?")
    if not version.startswith(FAIRSEQ_SERIES):
        _log.logger.warning(
            "tpp_plugin's changes to fairseq are written for fairseq %sx; this is fairseq "
            "%s (docs/fairseq_notes.md lists what they replace)",
            FAIRSEQ_SERIES,
            version,
        )


def apply(root_level_before_fairseq=None) -> None:
    """The corrections, the chosen checks and the chosen speed-ups (idempotent); the
    logging level first, so that the others' messages are filtered by it."""
    fixes.undo_debug_logging_of_fairseq_import(root_level_before_fairseq)
    try:  # both variables read before anything changes
        checks = chosen("TPP_FAIRSEQ_CHECKS", CHECKS, DEFAULT_CHECKS, "the checks")
        speedups = speed.chosen()
    except SwitchError:  # one line, whichever checks it would have chosen
        errors.install_excepthook()
        raise
    check_fairseq_version()
    fixes.allow_fairseq_checkpoints()
    fixes.keep_last_batches()
    fixes.bf16_without_tpu()
    fixes.leave_process_groups()
    fixes.block_ngrams_of_the_prefix()
    fixes.diverse_beam_search_by_position()
    fixes.score_left_padded_references()
    fixes.one_handler_per_log_file()
    epochs.free_finished_epochs()
    epochs.resume_across_batchings()
    epochs.stop_prefetching_at_exit()
    speed.states_of_either_layout()
    for name in checks:
        CHECKS[name]()
    speed.install(speedups)
