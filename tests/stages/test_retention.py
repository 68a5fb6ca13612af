"""Retention rules as pure functions of (step, metrics) records: no disk."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pipeline.stages.retention import Record, best_step, is_better, latest, to_delete


def test_is_better_min_max_and_nan():
    assert is_better(1.0, None, "min") and is_better(1.0, 2.0, "min") and not is_better(2.0, 1.0, "min")
    assert is_better(2.0, 1.0, "max") and not is_better(1.0, 1.0, "max")
    assert not is_better(math.nan, None, "min") and not is_better(math.nan, 1.0, "max")


def test_best_step_keeps_the_first_of_ties():
    records = [Record(1, {"val/loss": 3.0}), Record(2, {"val/loss": 1.0}), Record(3, {"val/loss": 1.0})]
    assert best_step(records, "val/loss", "min") == 2
    assert best_step(records, "val/loss", "max") == 1
    assert best_step(records, "val/acc", "max") is None


def test_to_delete_never_touches_protected_nor_newest():
    assert to_delete([1, 2, 3, 4, 5], keep=3, protected=set()) == [1, 2]
    assert to_delete([1, 2, 3, 4, 5], keep=3, protected={1}) == [2]
    assert to_delete([5], keep=1, protected=set()) == []
    assert to_delete([], keep=3, protected={7}) == []


def simulate(values: list[float], keep: int, mode: str):
    """What RotateLastN + BestVal decide over a run that saves every epoch: (kept steps, best step)."""
    on_disk: set[int] = set()
    periodic: list[int] = []
    best, best_at = None, None
    for epoch, v in enumerate(values, start=1):
        step = epoch * 10
        on_disk.add(step)
        periodic.append(step)
        if is_better(v, best, mode):
            best, best_at = v, step
        for old in to_delete(periodic, keep, {best_at} if best_at is not None else set()):
            on_disk.discard(old)
            periodic.remove(old)
    return on_disk, best_at


@given(st.lists(st.floats(allow_nan=True, allow_infinity=False, width=32), min_size=1, max_size=40),
       st.integers(1, 5), st.sampled_from(["min", "max"]))
def test_best_is_never_evicted_and_kept_set_matches_policy(values, keep, mode):
    kept, best_at = simulate(values, keep, mode)
    steps = [10 * (i + 1) for i in range(len(values))]
    expected = latest(steps, keep) | ({best_at} if best_at is not None else set())
    assert kept == expected
    oracle = best_step([Record(s, {"m": v}) for s, v in zip(steps, values)], "m", mode)
    assert best_at == oracle
    if best_at is not None:
        assert best_at in kept
