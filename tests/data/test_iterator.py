"""The DataIterator: every row once per epoch, drop_last, and an exact mid-epoch continuation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.iterator import DataIterator, restore_stream, stream_state
from pipeline.stateful import StateMismatch, restore


def gen(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


@st.composite
def sizes(draw):
    n = draw(st.integers(1, 64))
    return n, draw(st.integers(1, n))


@settings(max_examples=150, deadline=None)
@given(sizes(), st.integers(0, 2**32 - 1))
def test_each_row_exactly_once_per_epoch_and_last_partial_batch_dropped(nb, seed):
    n, bs = nb
    it = DataIterator(n, bs, gen(seed))
    bpe = n // bs
    assert it.batches_per_epoch == bpe
    oracle = gen(
        seed
    )  # the same generator, drawn in the iterator's order: one permutation per epoch
    for epoch in range(3):
        perm = oracle.permutation(n)
        batches = [it.next_ids() for _ in range(bpe)]
        assert it.epoch == epoch
        for b in batches:
            assert b.shape == (bs,) and b.dtype == np.int64  # every batch full: no partial batch
        ids = np.concatenate(batches)
        assert len(set(ids.tolist())) == len(ids) == bpe * bs  # no row twice in an epoch
        assert set(ids.tolist()) <= set(range(n))
        if n % bs == 0:
            assert sorted(ids.tolist()) == list(range(n))  # each row exactly once
        # the epoch is the permutation's first bpe*bs rows in order; the n % bs tail is dropped
        np.testing.assert_array_equal(ids, perm[: bpe * bs])
    assert it.next_ids().shape == (bs,) and it.epoch == 3


def test_drop_last_small_example():
    it = DataIterator(10, 4, gen(0))
    first = [it.next_ids() for _ in range(2)]
    dropped = set(range(10)) - set(np.concatenate(first).tolist())
    assert len(dropped) == 2 and it.epoch == 0 and it.cursor == 8
    third = it.next_ids()  # does not return the 2 leftover rows: a new epoch starts
    assert it.epoch == 1 and it.cursor == 4 and third.shape == (4,)


def test_epochs_are_reshuffled():
    it = DataIterator(24, 4, gen(1))
    e0 = np.concatenate([it.next_ids() for _ in range(6)])
    e1 = np.concatenate([it.next_ids() for _ in range(6)])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(24))
    assert not np.array_equal(e0, e1)


def test_batch_size_larger_than_data_is_rejected():
    with pytest.raises(
        ValueError, match=r"trainer.batch_size=4: must be between 1 and the 3 training samples"
    ):
        DataIterator(3, 4, gen(0))


def test_returned_ids_are_copies():
    it = DataIterator(8, 4, gen(0))
    ids = it.next_ids()
    ids[:] = -1
    assert (it.permutation >= 0).all()


@settings(max_examples=60, deadline=None)
@given(sizes(), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_continues_exactly_where_it_stopped(nb, k, seed):
    n, bs = nb
    after = 3 * (n // bs) + 2  # enough to cross at least two epoch boundaries after the stop
    reference = DataIterator(n, bs, gen(seed))
    expected = [reference.next_ids() for _ in range(k + after)]

    rng = gen(seed)
    it = DataIterator(n, bs, rng)
    got = [it.next_ids() for _ in range(k)]
    # what a checkpoint stores, through JSON like the run's RNG streams: a few integers, no permutation
    saved = json.loads(json.dumps(it.state_dict()))
    assert set(saved) == {"epoch", "cursor", "start"}
    saved_rng = json.loads(json.dumps(stream_state(rng)))
    del it, rng

    rng2 = gen(
        seed + 1
    )  # a differently-seeded generator: everything must come from the loaded state
    fresh = DataIterator(n, bs, rng2)
    fresh.load_state_dict(saved)
    restore_stream(rng2, saved_rng)
    assert (fresh.epoch, fresh.cursor) == (saved["epoch"], saved["cursor"])
    got += [fresh.next_ids() for _ in range(after)]
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"batch {i + 1} differs"
    assert fresh.epoch == reference.epoch and fresh.cursor == reference.cursor


def test_continuation_without_the_generator_state_diverges():
    """Negative control: the iterator's own state alone is not enough (the generator must be restored too)."""
    it = DataIterator(12, 4, gen(5))
    for _ in range(4):
        it.next_ids()
    reference = [it.next_ids() for _ in range(6)]

    it = DataIterator(12, 4, gen(5))
    for _ in range(4):
        it.next_ids()
    fresh = DataIterator(12, 4, gen(6))
    fresh.load_state_dict(it.state_dict())
    assert [b.tolist() for b in (fresh.next_ids() for _ in range(6))] != [
        b.tolist() for b in reference
    ]


class Afe8033Iterator:
    """afe8033's iterator, whose checkpoints hold its whole permutation: what they saved, to load now."""

    def __init__(self, n, bs, rng):
        self.n, self.bs, self.rng, self.epoch, self.cursor = n, bs, rng, 0, 0
        self.permutation = rng.permutation(n).astype(np.int64)

    def next_ids(self):
        if self.cursor + self.bs > self.n:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.permutation = self.rng.permutation(self.n).astype(np.int64)
        self.cursor += self.bs
        return self.permutation[self.cursor - self.bs : self.cursor].copy()

    def state_dict(self):
        return {"epoch": self.epoch, "permutation": self.permutation, "cursor": self.cursor}


@pytest.mark.parametrize("k", [0, 3, 5, 6, 13])
def test_a_state_saved_by_afe8033_continues_exactly_and_is_saved_as_it_came_until_its_epoch_ends(k):
    old, new = Afe8033Iterator(20, 3, gen(4)), DataIterator(20, 3, gen(4))
    for _ in range(k):
        assert np.array_equal(old.next_ids(), new.next_ids())  # the same draws, the same way
    rng = gen(99)
    it = DataIterator(20, 3, rng)
    restore({"data_iter": it}, {"data_iter": old.state_dict()}, only=("data_iter",))
    rng.bit_generator.state = old.rng.bit_generator.state
    saved = it.state_dict()
    assert set(saved) == {
        "epoch",
        "permutation",
        "cursor",
    }  # its epoch's permutation cannot be redrawn
    for _ in range(14):
        assert np.array_equal(it.next_ids(), old.next_ids())
    assert set(it.state_dict()) == {"epoch", "cursor", "start"}  # a new epoch: a few integers again


def test_the_saved_state_is_the_same_size_whatever_the_number_of_samples():
    sizes = set()
    for n in (10, 1000, 100_000):
        it = DataIterator(n, 4, gen(1))
        it.next_ids()
        sizes.add(len(json.dumps(it.state_dict())))
    assert len(sizes) == 1


def test_every_offset_draws_each_batch_from_the_stream_and_continues_exactly():
    rng = gen(3)
    it = DataIterator(10, 4, rng, offsets=500)
    oracle = gen(3)
    assert it.batches_per_epoch == 2
    first = [it.next_ids() for _ in range(3)]
    for b in first:  # uniform over [0, offsets), with replacement, as nanoGPT's torch.randint
        np.testing.assert_array_equal(b, oracle.integers(0, 500, size=4, dtype=np.int64))
    assert (it.epoch, it.cursor) == (1, 4)
    saved, saved_rng = json.loads(json.dumps(it.state_dict())), stream_state(rng)
    expected = [it.next_ids() for _ in range(5)]
    rng2 = gen(8)
    fresh = DataIterator(10, 4, rng2, offsets=500)
    fresh.load_state_dict(saved)
    restore_stream(rng2, saved_rng)
    assert all(np.array_equal(a, fresh.next_ids()) for a in expected)
    unrestored = DataIterator(10, 4, gen(8), offsets=500)
    unrestored.load_state_dict(
        saved
    )  # the stream not restored: the draws differ (the negative control)
    assert not all(np.array_equal(a, unrestored.next_ids()) for a in expected)


def test_load_copies_and_an_impossible_state_is_refused_untouched():
    it = DataIterator(8, 2, gen(0))
    it.next_ids()
    state = it.state_dict()
    assert (
        state["epoch"] == 0 and state["cursor"] == 2 and set(state) == {"epoch", "cursor", "start"}
    )
    fresh = DataIterator(8, 2, gen(1))
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(
        fresh.permutation, it.permutation
    )  # redrawn from where the epoch began
    state["start"]["state"] = "0"  # the saved objects may be reused: the loaded state is a copy
    np.testing.assert_array_equal(fresh.permutation, it.permutation)
    state = Afe8033Iterator(8, 2, gen(0)).state_dict()
    bad = [
        {**state, "permutation": np.arange(9)},  # another dataset's size
        {**state, "permutation": np.zeros(8, dtype=np.int64)},  # not a permutation
        {**state, "permutation": np.arange(8, dtype=np.float64)},
        {**state, "permutation": np.arange(8), "cursor": 9},  # past the end
        {**state, "permutation": np.arange(8), "epoch": -1},
        {**state, "permutation": np.arange(8), "cursor": 1.5},
        {**it.state_dict(), "start": {"bit_generator": "MT19937"}},  # not a stream's state
        {**it.state_dict(), "start": {**it.state_dict()["start"], "inc": "x"}},
        {**it.state_dict(), "start": {**it.state_dict()["start"], "extra": 1}},
        {**it.state_dict(), "start": [1, 2]},
        {**it.state_dict(), "permutation": np.arange(8)},  # both forms at once
        {"epoch": 0, "cursor": 0},
    ]
    for s in bad:
        before = (fresh.epoch, fresh.cursor, fresh.permutation.copy())
        with pytest.raises(StateMismatch, match="data_iter"):
            restore({"data_iter": fresh}, {"data_iter": s}, only=("data_iter",))
        assert (fresh.epoch, fresh.cursor) == before[:2] and np.array_equal(
            fresh.permutation, before[2]
        )
