"""Retention policies as pure functions of records (step, metrics, tags): table tests, no disk."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.checkpoint.retention import AnyOf, BestN, LatestN, Record, Steps, is_better, select_one


def R(step, tags=(), **metrics):
    return Record(step, {k.replace("_", "/"): v for k, v in metrics.items()}, frozenset(tags))


def test_is_better_min_max_and_non_finite():
    assert is_better(1.0, None, "min") and is_better(1.0, 2.0, "min") and not is_better(2.0, 1.0, "min")
    assert is_better(2.0, 1.0, "max") and not is_better(1.0, 1.0, "max")
    assert not is_better(math.nan, None, "min") and not is_better(math.nan, 1.0, "max")
    # Regression (#10.6): an infinite validation loss became best
    assert not is_better(math.inf, None, "min") and not is_better(-math.inf, 1.0, "min")
    assert not is_better(math.inf, 1.0, "max") and not is_better(None, None, "min")


RECORDS = [R(3, ["rot"], val_loss=2.0), R(6, ["rot", "best"], val_loss=1.0), R(9, ["rot"]),
           R(12, ["rot"], val_loss=1.0), R(15, ["best"], val_loss=math.inf), R(18, ["rot", "final"], val_loss=3.0)]


@pytest.mark.parametrize("policy, kept", [
    (LatestN(3), {12, 15, 18}),
    (LatestN(2, tag="rot"), {12, 18}),
    (LatestN(0, tag="rot"), set()),
    (LatestN(1, tag="final"), {18}),
    (LatestN(5, tag="nobody"), set()),
    (BestN("val/loss", "min", 1), {6}),  # ties keep the earlier step; inf is never best
    (BestN("val/loss", "min", 2), {6, 12}),
    (BestN("val/loss", "max", 1), {18}),  # inf excluded from max as well
    (BestN("val/acc", "max", 1), set()),
    (Steps(frozenset({3, 99})), {3}),
    (AnyOf((LatestN(2, tag="rot"), BestN("val/loss", "min", 1), LatestN(1))), {6, 12, 18}),
    (AnyOf(()), set()),
], ids=lambda x: repr(x) if not isinstance(x, set) else "")
def test_policy_table(policy, kept):
    assert policy.keep(RECORDS) == kept


def test_select_one_is_the_link_target():
    assert select_one(BestN("val/loss", "min", 1), RECORDS) == 6
    assert select_one(LatestN(1, tag="final"), RECORDS) == 18
    assert select_one(LatestN(1, tag="final"), RECORDS[:2]) is None


def simulate(values: list[float], keep: int, mode: str) -> tuple[set[int], int | None]:
    """What the default stages keep over a run that saves every epoch and evaluates at each save."""
    records, best = [], None
    kept = set()
    for epoch, v in enumerate(values, start=1):
        step = 10 * epoch
        tags = {"rotate"}
        if is_better(v, best, mode):
            best = v
            tags.add("best_val")
        records.append(R(step, tags, m=v))
        kept = AnyOf((LatestN(keep, "rotate"), BestN("m", mode, 1), LatestN(1))).keep(records)
        records = [r for r in records if r.step in kept]  # the store deleted the rest
    return kept, select_one(BestN("m", mode, 1), records)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=40),
       st.integers(1, 5), st.sampled_from(["min", "max"]))
def test_best_is_never_evicted_and_kept_set_matches_the_policies(values, keep, mode):
    kept, best_at = simulate(values, keep, mode)
    steps = [10 * (i + 1) for i in range(len(values))]
    finite = [(v, s) for v, s in zip(values, steps) if math.isfinite(v)]
    oracle = None
    if finite:
        target = min(v for v, _ in finite) if mode == "min" else max(v for v, _ in finite)
        oracle = min(s for v, s in finite if v == target)  # the first of ties
    assert best_at == oracle
    assert kept == set(steps[-keep:]) | ({oracle} if oracle is not None else set())
