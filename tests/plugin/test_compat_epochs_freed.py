"""An epoch's iterator and its data loader's worker processes freed when the training
lets go of it (tpp_fairseq.epochs): fairseq's iterator refers to itself through its
batch sampler, so only a cyclic garbage collection freed it, and with
``--update-epoch-batch-itr`` (an iterator every epoch) a training kept a worker process
more per epoch. fairseq's own iterator with one worker, the collector switched off as
it is between its rare collections."""

import gc
import multiprocessing
import threading
import weakref

import pytest
import torch
from fairseq.data import iterators

import tpp_plugin  # noqa: F401  (the plugin's corrections)

BATCHES = [[i, i + 1] for i in range(0, 12, 2)]


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i


def collate(ids):
    return ids


def epoch_iterator(epoch):
    """What ``--update-epoch-batch-itr`` makes at every epoch: a new iterator, its own
    data loader with persistent workers."""
    return iterators.EpochBatchIterator(
        dataset=Ids(),
        collate_fn=collate,
        batch_sampler=BATCHES,
        seed=1,
        num_workers=1,
        epoch=epoch,
        buffer_size=2,  # (fairseq-train's --data-buffer-size: a prefetching thread)
        reuse_dataloader=True,  # (as fairseq's tasks make it)
        persistent_workers=True,
    )


def prefetching_ended():
    """Wait for the epoch's prefetching thread, which holds its data loader until it has
    ended (it may still be ending when the epoch's last batch has been taken)."""
    for thread in threading.enumerate():
        if isinstance(thread, iterators.BackgroundConsumer):
            thread.join()


@pytest.fixture
def without_cyclic_collection():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_each_epochs_iterator_and_worker_are_freed_as_the_next_epoch_starts(
    without_cyclic_collection,
):
    """Four epochs, one iterator each: at most the current epoch's worker is alive, and
    the iterator before it is freed (fairseq's: one worker more per epoch)."""
    previous = None
    for epoch in range(1, 5):
        itr = epoch_iterator(epoch)
        batches = list(itr.next_epoch_itr(shuffle=True))
        assert sorted(map(tuple, batches)) == sorted(map(tuple, BATCHES))
        prefetching_ended()
        workers = multiprocessing.active_children()
        assert len(workers) == 1, f"epoch {epoch}: {len(workers)} data-loader workers alive"
        if previous is not None:
            assert previous() is None, f"epoch {epoch - 1}'s iterator still alive"
        previous = weakref.ref(itr)
        del itr
    assert previous() is None and multiprocessing.active_children() == []


def test_an_iterator_still_makes_every_epochs_batches():
    """The iterator makes epoch after epoch through its sampler (the reference it holds
    weakly), shuffled by epoch as fairseq's."""
    itr = iterators.EpochBatchIterator(
        dataset=Ids(),
        collate_fn=collate,
        batch_sampler=BATCHES,
        seed=1,
        epoch=1,
        reuse_dataloader=True,  # (each epoch's batches asked of the sampler it made first)
    )
    first = list(itr.next_epoch_itr(shuffle=True))
    second = list(itr.next_epoch_itr(shuffle=True))
    assert sorted(map(tuple, first)) == sorted(map(tuple, second)) == sorted(map(tuple, BATCHES))
    assert first != second and itr.epoch == 2
