"""Checkpoints that know their data (fairseq 0.12, any architecture): every checkpoint
the trainer writes records its data folder and a fingerprint of each of the task's
dictionaries (:mod:`tpp_fairseq.checkpoint_match`); loading one to resume, or through
``load_model_ensemble_and_task`` (``fairseq-generate``, ``fairseq-interactive``, the hub
interface), compares them with the task's before the weights are loaded, and resuming
also compares the model options (unless ``--reset-optimizer``). A mismatch is a
:class:`~tpp_fairseq.checkpoint_match.CheckpointMismatch` naming both data folders (or the
option and both values). A checkpoint written before the record existed is compared by
its embedding sizes only.

Resuming is also where a training that torchrun started as several processes, but that
fairseq did not join into one job, is stopped: each process would train a model of its
own into the same save dir (:class:`UnjoinedRanksError`).
"""

import contextvars
import os

from fairseq import checkpoint_utils
from fairseq import tasks as fairseq_tasks
from fairseq.trainer import Trainer
from omegaconf import OmegaConf

from . import checkpoint_match
from .errors import UserError
from ._log import log_once as _log_once

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

    def __init__(self, task=None, cfg=None, hint=""):
        self.task, self.cfg, self.hint = task, cfg, hint
        self.pending = []

    def loaded(self, state, path):
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
        if current is not None and not checkpoint_match.check_dictionaries(
            state, current, path, self.hint
        ):
            _log_once(
                "no_record",
                "%s records no dictionaries (written before the plugin recorded them): "
                "compared with %s by its embedding sizes only",
                path,
                current["data"],
            )
        if self.cfg is not None:
            checkpoint_match.check_resumed_options(state, self.cfg, path)


def trainer_state_dict(self):
    """``Trainer.state_dict`` with the record of the task's dictionaries."""
    state = _original_state_dict(self)
    record = checkpoint_match.record_of_task(self.task, getattr(self.cfg.task, "data", None))
    if record is not None:
        state[checkpoint_match.RECORD_KEY] = record
    return state


class UnjoinedRanksError(UserError):
    pass


def check_joined(trainer) -> None:
    """Under torchrun (``WORLD_SIZE`` > 1), the trainer must be one of the job's ranks:
    fairseq 0.12 joins them only when it counts several CUDA devices, so on CPUs, or
    with one visible GPU per process, each process trains alone."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1 and trainer.data_parallel_world_size == 1:
        raise UnjoinedRanksError(
            f"torchrun started {world} processes, but fairseq did not join them into one "
            "job (its world size is 1): each would train a model of its own into the same "
            "--save-dir. Start the command through scripts/fairseq_rank.sh, which hands "
            "fairseq torchrun's rank and world size: torchrun --no-python --nproc_per_node "
            f"{world} scripts/fairseq_rank.sh fairseq-train ..."
        )


def trainer_load_checkpoint(
    self,
    filename,
    reset_optimizer=False,
    reset_lr_scheduler=False,
    optimizer_overrides=None,
    reset_meters=False,
):
    """``Trainer.load_checkpoint``; the checkpoint is checked against the run's
    dictionaries and (unless ``--reset-optimizer``) model options when it is read, and
    the trainer against torchrun's world (:func:`check_joined`) before."""
    check_joined(self)
    cfg = None
    if not reset_optimizer:  # the configuration as state_dict() saves it
        cfg = (
            OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
            if OmegaConf.is_config(self.cfg)
            else self.cfg
        )
    hint = (
        "Resume with the data folder the run was trained on, or train on this one in another "
        "--save-dir"
    )
    token = _expectation.set(_Expectation(self.task, cfg, hint))
    try:
        return _original_trainer_load_checkpoint(
            self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters
        )
    finally:
        _expectation.reset(token)


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    state = _original_load_checkpoint_to_cpu(path, arg_overrides, load_on_all_ranks)
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
        hint="Use the data folder the model was trained on (or one with " "the same dictionaries)",
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
    """Install the record and the checks on fairseq's ``Trainer``, ``checkpoint_utils``
    and ``tasks.setup_task`` (idempotent)."""
    Trainer.state_dict = trainer_state_dict
    Trainer.load_checkpoint = trainer_load_checkpoint
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task
    fairseq_tasks.setup_task = setup_task
