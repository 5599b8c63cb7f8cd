"""A training resumed mid-epoch on another number of ranks, or with other batches
(tpp_fairseq.epochs): fairseq saves the position in one rank's share of the epoch's
batches, and failed ("dataloader mismatch") where that share is now shorter, or skipped
and repeated batches where it is longer. fairseq's own epoch iterator on a toy dataset,
its ranks' shares read batch by batch."""

import logging

import pytest
import torch
from fairseq.data import iterators

import tpp_plugin  # noqa: F401  (the plugin's corrections)
from tpp_fairseq import epochs

BATCHES = [[i] for i in range(17)]  # one sentence a batch: a batch is its sentence's id


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return len(BATCHES)

    def __getitem__(self, i):
        return i


def collate_first(ids):
    return ids[0] if ids else None


def iterator(shards, shard, batches=BATCHES):
    return iterators.EpochBatchIterator(
        dataset=Ids(),
        collate_fn=collate_first,
        batch_sampler=batches,
        seed=1,
        num_shards=shards,
        shard_id=shard,
        epoch=1,
    )


def trained(shards, updates, batches=BATCHES):
    """Every rank's batches of the epoch's first ``updates`` steps, and the state saved."""
    seen = []
    for shard in range(shards):
        itr = iterator(shards, shard, batches)
        epoch = itr.next_epoch_itr(shuffle=True)
        seen += [next(epoch) for _ in range(updates)]
    return [b for b in seen if b is not None], itr.state_dict()  # (every rank's is the same)


def resumed(state, shards, batches=BATCHES):
    """Every rank's batches for the rest of the epoch, resumed from ``state``."""
    rest = []
    for shard in range(shards):
        itr = iterator(shards, shard, batches)
        itr.load_state_dict(dict(state))
        rest += [b for b in itr.next_epoch_itr(shuffle=True) if b is not None]
    return rest


def whole_epoch():
    return [b for b in iterator(1, 0).next_epoch_itr(shuffle=True)]


@pytest.mark.parametrize(
    "before, after, updates, again",
    [(2, 1, 5, 0), (1, 2, 6, 0), (1, 2, 7, 1), (2, 3, 6, 0), (2, 2, 5, 0), (3, 2, 4, 0)],
)
def test_the_same_batches_dealt_to_other_ranks_go_on_after_those_trained(
    before, after, updates, again, caplog
):
    """Every batch of the epoch trained once, the up to ranks - 1 batches a conversion
    cannot split trained twice; fairseq's own skipped or repeated batches silently, or
    failed."""
    seen, state = trained(before, updates)
    assert state["num_shards"] == before and state["epoch_batches"] == len(BATCHES)
    with caplog.at_level(logging.INFO, logger="tpp_fairseq"):
        rest = resumed(state, after)
    assert sorted(seen + rest) == sorted(whole_epoch() + seen[len(seen) - again :]), (seen, rest)
    assert len(seen) + len(rest) == len(BATCHES) + again
    if before != after:
        assert f"dealt to {after} ranks ({before} when saved)" in caplog.text


def test_fairseqs_own_resume_skips_batches_or_fails():
    """What the correction answers, with fairseq's own load_state_dict."""
    seen, state = trained(1, 6)
    itr = iterator(2, 0)
    epochs._original_iterator_load_state_dict(itr, dict(state))
    rest = [b for b in itr.next_epoch_itr(shuffle=True) if b is not None]
    assert len(rest) == 9 - 6, "rank 0 of 2 goes on after its own 6th batch: 6 never trained"
    seen, state = trained(1, 12)
    with pytest.raises(RuntimeError, match="dataloader mismatch"):
        epochs._original_iterator_load_state_dict(iterator(2, 0), dict(state))
    seen, state = trained(2, 8)
    with pytest.raises(RuntimeError, match="dataloader mismatch"):
        epochs._original_iterator_load_state_dict(iterator(3, 0), dict(state))


def test_batches_grouped_otherwise_start_the_epoch_over(caplog):
    """Another --max-tokens (here two sentences a batch): the epoch starts over, said."""
    seen, state = trained(2, 5)
    pairs = [BATCHES[i] + BATCHES[i + 1] for i in range(0, 16, 2)] + [BATCHES[16]]
    with caplog.at_level(logging.WARNING, logger="tpp_fairseq"):
        rest = resumed(state, 2, pairs)
    assert len(rest) == len(pairs), "the whole epoch"
    assert "epoch 1 starts over: its batches are grouped otherwise now (9, not 17)" in caplog.text


def test_as_many_batches_of_other_sizes_start_the_epoch_over(caplog):
    """Batches grouped otherwise but as many (other data, another --max-tokens): the
    epoch starts over, said, not resumed at a position in other batches."""
    seen, state = trained(2, 5)
    assert len(state["epoch_batch_sizes"]) == 32
    moved = [BATCHES[0] + BATCHES[1], []] + BATCHES[2:]  # (one sentence moved: 17 batches)
    with caplog.at_level(logging.WARNING, logger="tpp_fairseq"):
        rest = resumed(state, 2, moved)
    assert sorted(rest) == sorted(b[0] for b in moved if b), "the whole epoch"
    assert "epoch 1 starts over: its batches are grouped otherwise now (as many, 17," in caplog.text
    caplog.clear()
    without_sizes = {k: v for k, v in state.items() if k != "epoch_batch_sizes"}
    with caplog.at_level(logging.WARNING, logger="tpp_fairseq"):
        resumed(without_sizes, 2, moved)  # (saved before the sizes were: counted only)
    assert "starts over" not in caplog.text


def test_batches_of_the_same_sizes_and_other_sentences_go_on(caplog):
    """Without --update-epoch-batch-itr fairseq groups sentences of equal length anew, at
    random, by the epoch a process starts in: a resumed process's batches hold other
    sentences in batches of the same sizes, and it goes on from the saved position, as
    fairseq does (it does not start a whole epoch over)."""
    seen, state = trained(2, 5)
    regrouped = BATCHES[::-1]  # (same sizes, other sentences in each)
    with caplog.at_level(logging.WARNING, logger="tpp_fairseq"):
        rest = resumed(state, 2, regrouped)
    assert "starts over" not in caplog.text
    assert len(seen) + len(rest) == len(BATCHES)


def test_the_state_of_fairseqs_grouped_iterator_is_its_own():
    """fairseq's GroupedEpochBatchIterator (several samplers, speech-text tasks): its
    mid-epoch state as fairseq saves it (its batches are groups, not sentences)."""
    groups = [[[0, 1], [2, 3, 4], [5]], [[6, 7], [8, 9, 10, 11]]]
    itr = iterators.GroupedEpochBatchIterator(Ids(), collate_first, groups, seed=1, epoch=1)
    next(itr.next_epoch_itr(shuffle=True))
    assert itr.state_dict() == {"version": 2, "epoch": 1, "iterations_in_epoch": 1, "shuffle": True}


def test_a_state_saved_without_the_plugin_resumes_as_fairseq_or_starts_over(caplog):
    """A checkpoint fairseq wrote alone: its position taken as it is where it lies in the
    epoch (fairseq's own resume), the epoch started over where it lies past its end."""
    seen, state = trained(2, 5)
    legacy = {k: v for k, v in state.items() if not k.startswith(("num_shards", "epoch_"))}
    assert sorted(seen + resumed(legacy, 2)) == sorted(whole_epoch())
    seen, state = trained(1, 12)
    legacy = {k: v for k, v in state.items() if not k.startswith(("num_shards", "epoch_"))}
    with caplog.at_level(logging.WARNING, logger="tpp_fairseq"):
        rest = resumed(legacy, 2)
    assert len(rest) == len(BATCHES)
    assert (
        "epoch 1 starts over: it stopped at batch 12 of a rank, past this epoch's end"
        in caplog.text
    )


def test_the_state_of_an_epochs_end_is_fairseqs():
    """At an epoch's end fairseq saves the next epoch at its start: nothing added."""
    itr = iterator(1, 0)
    for _ in itr.next_epoch_itr(shuffle=True):
        pass
    assert itr.state_dict() == {"version": 2, "epoch": 2, "iterations_in_epoch": 0, "shuffle": True}


def grouped_epoch(itr, update_freq):
    """The rest of an epoch as fairseq's training loop takes it: ``update_freq`` batches
    an update (GroupedIterator), then whether the epoch has ended."""
    updates = list(iterators.GroupedIterator(itr.next_epoch_itr(shuffle=True), update_freq))
    return [b for update in updates for b in update if b is not None], itr.end_of_epoch()


@pytest.mark.parametrize(
    "before, after, freq_before, freq_after, updates",
    [(1, 2, 3, 3, 1), (2, 3, 2, 2, 3), (1, 1, 3, 2, 1), (1, 1, 2, 3, 2), (4, 3, 2, 2, 1)],
)
def test_an_epoch_resumed_at_a_batch_no_multiple_of_update_freq_ends(
    before, after, freq_before, freq_after, updates
):
    """Resumed at a batch that is no multiple of --update-freq (after other ranks, or with
    another --update-freq), the epoch's last update is taken and the epoch ends: fairseq
    counted one update too many, left the last one untaken, and trained the epoch again."""
    seen, state = trained(before, updates * freq_before)
    rest, ended = [], []
    for shard in range(after):
        itr = iterator(after, shard)
        itr.load_state_dict(dict(state))
        batches, end = grouped_epoch(itr, freq_after)
        rest += batches
        ended.append(end)
    assert all(ended), "every rank's epoch ended"
    assert set(seen + rest) == set(whole_epoch())


def test_fairseqs_own_grouping_leaves_the_last_update_of_such_an_epoch():
    """What the correction answers: fairseq's GroupedIterator, resumed at batch 1 of 17
    with 3 batches an update, stops one update short and the epoch has not ended."""
    seen, state = trained(1, 1)
    itr = iterator(1, 0)
    itr.load_state_dict(dict(state))
    base = itr.next_epoch_itr(shuffle=True)
    grouped = iterators.GroupedIterator.__new__(iterators.GroupedIterator)
    epochs._original_grouped_iterator_init(grouped, base, 3)
    assert len(list(grouped)) == 5 and not itr.end_of_epoch(), "15 of the 16 batches left"
