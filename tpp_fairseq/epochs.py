"""Corrections of fairseq's epoch iterators (``fairseq.data.iterators``), always applied;
each described, with the failure it answers, in docs/fairseq_notes.md.

- **Finished epochs' data-loader workers**: an epoch's iterator refers to itself through
  the batch sampler of its data loader (a bound method), so only Python's cyclic garbage
  collector frees it, and with it the loader's persistent worker processes, at a
  collection that may not come for many epochs (``--update-epoch-batch-itr`` makes an
  iterator every epoch: a process and its memory more per epoch and rank). The sampler
  refers to its iterator weakly: an epoch's iterator and its workers are freed when the
  training lets go of it.
- **Resuming mid-epoch on another number of ranks or batches**: the position fairseq saves
  is one rank's; it is kept with how the epoch was dealt and converted on resume.
- **Prefetching threads at exit** (one inside torch's C++ code as Python finalizes aborts
  a command that succeeded): stopped at exit.
"""

import atexit
import hashlib
import math
import queue
import threading
import time
import weakref

import numpy as np
from fairseq.data import iterators

from ._log import log_once as _log_once, logger

# --------------------------------------------------------------------------- finished epochs

_original_frozen_batch_sampler_init = iterators.FrozenBatchSampler.__init__


class _WeakMethod:
    """Calls a bound method without keeping its object alive."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args, **kwargs):
        method = self._method()
        if method is None:
            raise RuntimeError("the epoch iterator of this batch sampler has been freed")
        return method(*args, **kwargs)


def frozen_batch_sampler_init(self, ordered_batches, *args, **kwargs):
    """fairseq's ``FrozenBatchSampler``, referring to its epoch iterator's
    ``ordered_batches`` weakly (its iterator makes it and asks it for each epoch's
    batches: it never outlives it in use)."""
    _original_frozen_batch_sampler_init(self, ordered_batches, *args, **kwargs)
    if getattr(ordered_batches, "__self__", None) is not None:
        self.ordered_batches = _WeakMethod(ordered_batches)
        _log_once(
            "free_epochs",
            "epoch iterators freed with their data-loader workers when their epoch is over "
            "(fairseq's batch sampler refers to its iterator weakly)",
        )


def free_finished_epochs() -> None:
    """Install :func:`frozen_batch_sampler_init` (idempotent)."""
    iterators.FrozenBatchSampler.__init__ = frozen_batch_sampler_init


# --------------------------------------------------------------------------- resuming mid-epoch

_original_iterator_state_dict = iterators.EpochBatchIterator.state_dict
_original_iterator_load_state_dict = iterators.EpochBatchIterator.load_state_dict


def iterator_state_dict(self):
    """fairseq's epoch iterator state, and mid-epoch how the epoch's batches were dealt:
    to how many ranks (``num_shards``), how many batches it had, and of what sizes."""
    state = _original_iterator_state_dict(self)
    # (fairseq's multilingual GroupedEpochBatchIterator deals groups of batches: its own)
    if state.get("iterations_in_epoch", 0) > 0 and type(self) is iterators.EpochBatchIterator:
        state.update(
            num_shards=self.num_shards,
            epoch_batches=len(self.frozen_batches),
            epoch_batch_sizes=batch_sizes_digest(self),
        )
    return state


def batch_sizes_digest(itr) -> str:
    """A digest of the sizes of the epoch's batches (sentences each, in order): another
    grouping of as many batches (another ``--max-tokens``, other data) differs. Not of
    their sentences: fairseq groups sentences of equal length at random, by the epoch a
    process starts in unless ``--update-epoch-batch-itr``, and resumes such batches at
    the same position, as the plugin does."""
    batches = itr.frozen_batches
    sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
    return hashlib.blake2b(sizes.tobytes(), digest_size=16).hexdigest()


def iterator_load_state_dict(self, state_dict):
    """fairseq's, resuming mid-epoch where the batches are dealt otherwise now (see
    :func:`resumed_position`)."""
    if state_dict.get("iterations_in_epoch", 0) > 0 and type(self) is iterators.EpochBatchIterator:
        state_dict = dict(state_dict, iterations_in_epoch=resumed_position(self, state_dict))
    return _original_iterator_load_state_dict(self, state_dict)


def resumed_position(itr, state) -> int:
    """The batch of each rank a training resumed mid-epoch goes on from. fairseq saves
    the position in one rank's share of the epoch's batches (rank r has batches r, r + N,
    ... of N ranks) and fails ("dataloader mismatch") where that share is now shorter, or
    silently skips or repeats batches where it is longer. The same batches dealt to
    another number of ranks go on after those trained (up to ranks - 1 batches again);
    batches grouped otherwise (another ``--max-tokens``), the epoch starts over."""
    position, epoch = state["iterations_in_epoch"], state["epoch"]
    batches, shards = len(itr.frozen_batches), itr.num_shards
    saved_batches, saved_shards = state.get("epoch_batches"), state.get("num_shards")
    saved_sizes = state.get("epoch_batch_sizes")  # (older checkpoints: none)
    if saved_batches is None:  # (saved without the plugin: fairseq's own, where it can)
        if position < math.ceil(batches / shards):
            return position
        why = f"it stopped at batch {position} of a rank, past this epoch's end"
    elif saved_batches != batches:
        why = f"its batches are grouped otherwise now ({batches}, not {saved_batches})"
    elif saved_sizes is not None and saved_sizes != batch_sizes_digest(itr):
        why = f"its batches are grouped otherwise now (as many, {batches}, of other sizes)"
    elif saved_shards == shards:
        return position
    elif getattr(itr, "grouped_shuffling", False):
        why = f"--grouped-shuffling ordered its batches for {saved_shards} ranks"
    else:
        done = min(position * saved_shards, batches)
        logger.info(
            "resuming epoch %d after %d of its %d batches, dealt to %d ranks (%d when saved)",
            epoch,
            done // shards * shards,
            batches,
            shards,
            saved_shards,
        )
        return done // shards
    logger.warning("resuming: epoch %d starts over: %s", epoch, why)
    return 0


_original_grouped_iterator_init = iterators.GroupedIterator.__init__


def grouped_iterator_init(self, iterable, chunk_size, skip_remainder_batch=False):
    """fairseq's ``GroupedIterator`` (``--update-freq`` batches an update), its length
    the updates done plus those the batches left make: fairseq counts ``ceil(L / k)`` for
    the epoch and ``ceil(n / k)`` done, one update too many where a resumed epoch goes on
    from a batch ``n`` that is no multiple of ``k`` (another ``--update-freq``, or other
    ranks): the last update was never taken, and the epoch ran again from its start."""
    _original_grouped_iterator_init(self, iterable, chunk_size, skip_remainder_batch)
    if not skip_remainder_batch:
        left = len(iterable) - getattr(iterable, "n", 0)
        self.total = self.n + math.ceil(left / chunk_size)


def resume_across_batchings() -> None:
    """Install :func:`iterator_state_dict`, :func:`iterator_load_state_dict` and
    :func:`grouped_iterator_init` (idempotent)."""
    iterators.EpochBatchIterator.state_dict = iterator_state_dict
    iterators.EpochBatchIterator.load_state_dict = iterator_load_state_dict
    iterators.GroupedIterator.__init__ = grouped_iterator_init


# --------------------------------------------------------------------------- prefetching at exit

#: seconds the exit waits for fairseq's prefetching threads to stop
STOP_TIMEOUT = 10.0


def stop_prefetching() -> None:
    """Stop fairseq's batch-prefetching threads (``BackgroundConsumer``, daemon threads)
    before the interpreter finalizes: one left inside torch's C++ code then is ended by a
    forced unwind that aborts the process ("terminate called without an active
    exception", SIGABRT) after a command that succeeded, e.g. a training stopped by
    ``--max-update`` while the next batches were being made. Each stops after the batch
    it is making; the queue it fills is emptied so that it can."""
    deadline = time.monotonic() + STOP_TIMEOUT
    for thread in threading.enumerate():
        if not isinstance(thread, iterators.BackgroundConsumer):
            continue
        thread._max_len = 0  # fairseq's own stop: checked after each batch is queued
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.01)


def stop_prefetching_at_exit() -> None:
    """Register :func:`stop_prefetching` to run at exit (idempotent: registered once)."""
    atexit.unregister(stop_prefetching)
    atexit.register(stop_prefetching)
