"""Transformer++ for fairseq: load with ``--user-dir tpp_plugin``.

Registers the ``transformer_pp`` model and its presets, the ``translation_with_tags``
task and the ``label_smoothed_cross_entropy_with_tags`` criterion, after applying the
project's changes to the fairseq and torch it runs on (:mod:`tpp_fairseq`: corrections
of fairseq 0.12, and the checks and speed-ups ``TPP_FAIRSEQ_CHECKS`` and
``TPP_FAIRSEQ_SPEEDUPS`` choose).
"""

import logging
import sys

# the root logger's level before fairseq is first imported (None: it already was), so
# that a DEBUG level the program chose itself is told apart from the one fairseq's import sets
_root_level = None if "fairseq" in sys.modules else logging.getLogger().level

import tpp_fairseq  # noqa: E402  (imports fairseq)

tpp_fairseq.apply(root_level_before_fairseq=_root_level)

from . import criterions, models, tasks  # noqa: E402,F401  (registration side effects)

__version__ = "0.3.0"
