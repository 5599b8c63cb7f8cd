"""Checkpoints that know their data: a checkpoint that records its dictionaries (the
plugin's task writes the record, :mod:`tpp_fairseq.checkpoint_match`) is compared with the
task's dictionaries before its weights are loaded, to resume or through
``load_model_ensemble_and_task`` (``fairseq-generate``, ``fairseq-interactive``, the hub
interface); resuming also compares the model options (unless ``--reset-optimizer``). A
mismatch is a :class:`~tpp_fairseq.checkpoint_match.CheckpointMismatch` naming both data
folders (or the option and both values). A checkpoint without a record (of another task)
loads as fairseq loads it.

fairseq gives a task no say when a checkpoint is loaded to resume (``Trainer`` does not
hand it its saved state), nor when a model trained with it is loaded with another task
(``--task translation`` at inference): so these checks wrap fairseq's loaders, and act on
the checkpoints that carry a record only. A file that is no checkpoint (empty, text, cut
short) is a :class:`~tpp_tools.checkpoint_files.CheckpointError` naming it and what it is.
"""

import contextvars

from fairseq import checkpoint_utils
from fairseq import tasks as fairseq_tasks
from fairseq.trainer import Trainer
from omegaconf import OmegaConf

from . import checkpoint_match

# --------------------------------------------------------------------------- checkpoints that know their data

_original_state_dict = Trainer.state_dict
_original_trainer_load_checkpoint = Trainer.load_checkpoint
_original_load_checkpoint_to_cpu = checkpoint_utils.load_checkpoint_to_cpu
_original_load_model_ensemble_and_task = checkpoint_utils.load_model_ensemble_and_task
_original_setup_task = fairseq_tasks.setup_task

#: what a checkpoint being loaded is for (an :class:`_Expectation`), while it is loaded
_expectation = contextvars.ContextVar("tpp_checkpoint_expectation", default=None)


class _Expectation:
    """The task (dictionaries) a checkpoint is loaded for and, when a run resumes, the
    run's configuration; ``task`` None: the task that fairseq sets up from the first
    checkpoint, whose loaded states wait in ``pending`` until it is known."""

    def __init__(self, task=None, cfg=None, hint="", new_training=False):
        self.task, self.cfg, self.hint = task, cfg, hint
        self.new_training = new_training  # (its tag heads may start afresh)
        self.pending = []

    def loaded(self, state, path):
        if checkpoint_match.recorded(state) is None:
            return  # not written by the plugin's task: as fairseq loads it
        if self.task is None:
            self.pending.append((checkpoint_match.what_checks_read(state), path))
        else:
            self.check(state, path)

    def adopt(self, task):
        if self.task is None:
            self.task = task
            pending, self.pending = self.pending, []
            for state, path in pending:
                self.check(state, path)

    def check(self, state, path):
        current = checkpoint_match.record_of_task(self.task)
        if current is not None:
            checkpoint_match.check_dictionaries(
                state, current, path, self.hint, new_tag_heads=self.new_training
            )
        if self.cfg is not None:
            checkpoint_match.check_resumed_options(state, self.cfg, path)


def trainer_state_dict(self):
    """``Trainer.state_dict``, whose task state records the task's dictionaries where the
    task does not (the plugin's task does)."""
    state = _original_state_dict(self)
    if checkpoint_match.recorded(state) is None:
        record = checkpoint_match.record_of_task(self.task, getattr(self.cfg.task, "data", None))
        if record is not None:
            checkpoint_match.file_record(state, record)
    return state


def trainer_load_checkpoint(
    self,
    filename,
    reset_optimizer=False,
    reset_lr_scheduler=False,
    optimizer_overrides=None,
    reset_meters=False,
):
    """``Trainer.load_checkpoint``; a checkpoint with a record is checked against the
    run's dictionaries and (unless ``--reset-optimizer``) model options when it is read.
    A new training from its weights (``--finetune-from-model``, ``--reset-optimizer``)
    may have other tag dictionaries: their heads start as initialised."""
    cfg = None
    if not reset_optimizer:  # the configuration as state_dict() saves it
        cfg = (
            OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
            if OmegaConf.is_config(self.cfg)
            else self.cfg
        )
        hint = (
            "Resume with the data folder the run was trained on, or train on this one in "
            "another --save-dir"
        )
    else:
        hint = (
            "Train from these weights on data binarized with the checkpoint's dictionaries "
            "(fairseq-preprocess --srcdict, --tgtdict)"
        )
    token = _expectation.set(_Expectation(self.task, cfg, hint, new_training=reset_optimizer))
    try:
        return _original_trainer_load_checkpoint(
            self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters
        )
    finally:
        _expectation.reset(token)


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    try:
        state = _original_load_checkpoint_to_cpu(path, arg_overrides, load_on_all_ranks)
    except Exception as error:  # torch's: KeyError: 101 for a text file, a miniz error...
        from tpp_tools.checkpoint_files import CheckpointError, format_problem

        problem = format_problem(path)
        if problem is None:  # (a whole file: what torch says is the reason)
            raise
        raise CheckpointError(path, problem) from error
    expectation = _expectation.get()
    if expectation is not None:
        expectation.loaded(state, path)
    return state


load_checkpoint_to_cpu.__doc__ = _original_load_checkpoint_to_cpu.__doc__


def load_model_ensemble_and_task(
    filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1, state=None
):
    """``checkpoint_utils.load_model_ensemble_and_task``; each checkpoint is checked
    against the task's dictionaries (the given task, or the one set up from the first
    checkpoint) before its weights are loaded."""
    expectation = _Expectation(
        task,
        hint="Use the data folder the model was trained on (or one with the same dictionaries)",
    )
    if state is not None:  # given by the caller: not read here
        expectation.loaded(state, filenames[0] if filenames else "the checkpoint")
    token = _expectation.set(expectation)
    try:
        return _original_load_model_ensemble_and_task(
            filenames, arg_overrides, task, strict, suffix, num_shards, state
        )
    finally:
        _expectation.reset(token)


def setup_task(cfg, **kwargs):
    task = _original_setup_task(cfg, **kwargs)
    expectation = _expectation.get()
    if expectation is not None:
        expectation.adopt(task)
    return task


setup_task.__doc__ = _original_setup_task.__doc__


def checkpoints_that_know_their_data() -> None:
    """Install the checks on fairseq's ``Trainer``, ``checkpoint_utils`` and
    ``tasks.setup_task`` (idempotent)."""
    Trainer.load_checkpoint = trainer_load_checkpoint
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task
    fairseq_tasks.setup_task = setup_task


def record_every_task() -> None:
    """Have the trainer record the dictionaries of any task (idempotent)."""
    Trainer.state_dict = trainer_state_dict
