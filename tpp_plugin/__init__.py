"""Transformer++ for fairseq: load with ``--user-dir tpp_plugin``.

Registers the ``transformer_pp`` model and its presets, the ``translation_with_tags``
task and the ``label_smoothed_cross_entropy_with_tags`` criterion, after applying the
plugin's corrections to the fairseq and torch it runs on (:mod:`tpp_plugin.compat`).
"""

from . import compat

compat.apply()

from . import criterions, models, tasks  # noqa: E402,F401  (registration side effects)

__version__ = "0.2.1"
