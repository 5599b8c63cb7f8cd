"""``tpp-study``: does Transformer++ translate better than the Transformer?

Variants (a)-(d) trained under one budget, several seeds each, scored and compared by
the paired bootstrap in one report (docs/study.md). One module per job: ``config`` (the
variants and configurations), ``data`` (the corpus carved and prepared), ``runs`` (each
run's identity, command and steps), ``report`` (statistics, curves, Markdown), ``cli``
(the command line) and ``slurm`` (every run a SLURM job).
"""

from .cli import main, parse_args
from .commands import CHILDREN, count_lines, log
from .config import CONFIGS, PROG, TAG_FIELDS, VARIANTS, Config, StudyError, tag_settings
from .data import data_identity, fingerprint, prepare_data
from .report import significance, t_interval, write_report
from .runs import RUN_VERSION, Run, execute, gpu_slots, plan_runs, train_command, visible_gpus

__all__ = [
    "CHILDREN",
    "CONFIGS",
    "PROG",
    "RUN_VERSION",
    "TAG_FIELDS",
    "VARIANTS",
    "Config",
    "Run",
    "StudyError",
    "count_lines",
    "data_identity",
    "execute",
    "fingerprint",
    "gpu_slots",
    "log",
    "main",
    "parse_args",
    "plan_runs",
    "prepare_data",
    "significance",
    "t_interval",
    "tag_settings",
    "train_command",
    "visible_gpus",
    "write_report",
]
