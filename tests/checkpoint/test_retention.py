"""Retention policies as pure functions of records (step, metrics, tags): table tests, no disk."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.checkpoint.retention import (
    AnyOf,
    BestN,
    LatestN,
    Named,
    Record,
    admit,
    is_better,
    select_one,
)


def R(step, tags=(), **metrics):
    return Record(step, {k.replace("_", "/"): v for k, v in metrics.items()}, frozenset(tags))


def test_is_better_min_max_and_non_finite():
    assert (
        is_better(1.0, None, "min")
        and is_better(1.0, 2.0, "min")
        and not is_better(2.0, 1.0, "min")
    )
    assert is_better(2.0, 1.0, "max") and not is_better(1.0, 1.0, "max")
    assert not is_better(math.nan, None, "min") and not is_better(math.nan, 1.0, "max")
    # Regression (#10.6): an infinite validation loss became best
    assert not is_better(math.inf, None, "min") and not is_better(-math.inf, 1.0, "min")
    assert not is_better(math.inf, 1.0, "max") and not is_better(None, None, "min")


RECORDS = [
    R(3, ["rot"], val_loss=2.0),
    R(6, ["rot", "best"], val_loss=1.0),
    R(9, ["rot"]),
    R(12, ["rot"], val_loss=1.0),
    R(15, ["best"], val_loss=math.inf),
    R(18, ["rot", "final"], val_loss=3.0),
]


@pytest.mark.parametrize(
    "policy, kept",
    [
        (LatestN(3), {12, 15, 18}),
        (LatestN(2, tag="rot"), {12, 18}),
        (LatestN(0, tag="rot"), set()),
        (LatestN(1, tag="final"), {18}),
        (LatestN(5, tag="nobody"), set()),
        (BestN("val/loss", "min", 1), {6}),  # ties keep the earlier step; inf is never best
        (BestN("val/loss", "min", 2), {6, 12}),
        (BestN("val/loss", "max", 1), {18}),  # inf excluded from max as well
        (BestN("val/acc", "max", 1), set()),
        (AnyOf((LatestN(2, tag="rot"), BestN("val/loss", "min", 1), LatestN(1))), {6, 12, 18}),
        (AnyOf(()), set()),
    ],
    ids=lambda x: repr(x) if not isinstance(x, set) else "",
)
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


@given(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=40),
    st.integers(1, 5),
    st.sampled_from(["min", "max"]),
)
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


# --- the k best (stages.best_val.keep): the stage's rule (admit) and the policy (BestN) are one order


@pytest.mark.parametrize(
    "top, value, step, n, mode, after",
    [
        ([], 2.0, 5, 1, "min", [(2.0, 5)]),
        (
            [(2.0, 5)],
            2.0,
            9,
            1,
            "min",
            None,
        ),  # a tie does not displace the earlier step (keep=1 as ever)
        ([(2.0, 5)], 1.0, 9, 1, "min", [(1.0, 9)]),
        ([(2.0, 5)], 3.0, 9, 2, "min", [(2.0, 5), (3.0, 9)]),  # room left: any finite value enters
        ([(2.0, 5), (3.0, 9)], 3.0, 12, 2, "min", None),  # ties the 2nd best: the earlier one stays
        ([(2.0, 5), (3.0, 9)], 2.5, 12, 2, "min", [(2.0, 5), (2.5, 12)]),
        (
            [(2.0, 5), (3.0, 9)],
            2.0,
            12,
            3,
            "min",
            [(2.0, 5), (2.0, 12), (3.0, 9)],
        ),  # equal values: older first
        ([(3.0, 5), (2.0, 9)], 2.5, 12, 2, "max", [(3.0, 5), (2.5, 12)]),
        ([(3.0, 5), (2.0, 9)], 1.0, 12, 2, "max", None),
        ([], math.nan, 5, 3, "min", None),
        ([], math.inf, 5, 3, "max", None),
        ([], -math.inf, 5, 3, "min", None),
        ([(1.0, 5)], None, 9, 3, "min", None),  # no evaluation at this step
    ],
)
def test_admit_is_the_top_k_with_the_earlier_step_first_among_equals(
    top, value, step, n, mode, after
):
    assert admit(top, value, step, n, mode) == after


TIES = [
    R(2, val_loss=1.0),
    R(4, val_loss=3.0),
    R(6, val_loss=1.0),
    R(8, val_loss=math.nan),
    R(10, val_loss=2.0),
    R(12, val_loss=1.0),
]


@pytest.mark.parametrize(
    "policy, kept",
    [
        (BestN("val/loss", "min", 1), {2}),
        (BestN("val/loss", "min", 2), {2, 6}),
        (BestN("val/loss", "min", 3), {2, 6, 12}),
        (BestN("val/loss", "min", 4), {2, 6, 12, 10}),
        (BestN("val/loss", "max", 2), {4, 10}),
        (BestN("val/loss", "max", 9), {2, 4, 6, 10, 12}),  # NaN never kept
        (
            BestN("val/loss", "min", 3, since=6),
            {10, 12},
        ),  # a history begun at 6 ranks what came after it only
    ],
    ids=repr,
)
def test_best_n_with_ties_and_nan(policy, kept):
    assert policy.keep(TIES) == kept


def simulate_k(values: list[float], k: int, rotate: int, mode: str, evaluate_every: int = 1):
    """The default stages with best_val.keep=k over a run saving every epoch (rotate-last-`rotate`) and evaluating
    every `evaluate_every` epochs; the store deletes what no policy keeps after every save."""
    records, top, kept = [], [], set()
    for epoch, v in enumerate(values, start=1):
        step = 10 * epoch
        evaluated = epoch % evaluate_every == 0
        tags = {"rotate"} | ({"final"} if epoch == len(values) else set())
        if evaluated and (new := admit(top, v, step, k, mode)) is not None:
            top = new
            tags.add("best_val")
        records.append(R(step, tags, **({"m": v} if evaluated else {})))
        policy = AnyOf(
            (LatestN(rotate, "rotate"), BestN("m", mode, k), LatestN(1, "final"), LatestN(1))
        )
        kept = policy.keep(records)
        assert {s for _, s in top} <= kept, "a best checkpoint the stage counts was deleted"
        records = [r for r in records if r.step in kept]
    return kept, select_one(BestN("m", mode, 1), records), top


@given(
    st.lists(
        st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0, math.nan, math.inf, -math.inf]),
        min_size=1,
        max_size=30,
    )
    | st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=30),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from(["min", "max"]),
    st.integers(1, 3),
)
def test_top_k_composed_with_rotate_and_final_keeps_exactly_the_oracle(
    values, k, rotate, mode, every
):
    kept, best_at, top = simulate_k(values, k, rotate, mode, every)
    steps = [10 * (i + 1) for i in range(len(values))]
    sign = 1.0 if mode == "min" else -1.0
    evaluated = [
        (v, s)
        for i, (v, s) in enumerate(zip(values, steps))
        if (i + 1) % every == 0 and math.isfinite(v)
    ]
    oracle = sorted(evaluated, key=lambda vs: (sign * vs[0], vs[1]))[
        :k
    ]  # the k best, the earlier of equals first
    assert top == [(float(v), s) for v, s in oracle]
    assert kept == set(steps[-rotate:]) | {s for _, s in oracle}
    assert best_at == (oracle[0][1] if oracle else None)


def test_named_links_name_the_kept_steps_and_own_only_their_own_names():
    named = Named(BestN("val/loss", "min", 2), lambda r: f"{r.step}-{r.metrics['val/loss']:.1f}")
    assert named.links(TIES) == {"2-1.0": 2, "6-1.0": 6}
    assert (
        named.name(TIES[2]) == "6-1.0"
        and named.name(TIES[2]) != "6-2.0"
        and named.name(TIES[2]) != "best"
    )
    assert (
        Named(BestN("val/loss", "min", 2), lambda r: None).links(TIES) == {}
    )  # no name: the step's only
