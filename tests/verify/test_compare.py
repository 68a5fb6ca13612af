"""The one comparator of "the same state" (pipeline/verify/compare.py), which the verifier and roundtrip share:
exact means the same bytes, a tolerance loosens arrays only, and structure is never loosened."""

from __future__ import annotations

import numpy as np

from pipeline.stateful import PARTS
from pipeline.verify.compare import compare, diff, first_difference, machine


def test_exact_is_the_same_bytes():
    a = np.array([0.0, 1.5, -2.0])
    assert diff(a, a.copy())["ok"] and diff(a, a.copy())["max_abs_diff"] == 0.0
    zero, negzero = np.zeros(2), -np.zeros(2)
    assert (
        np.array_equal(zero, negzero) and not diff(zero, negzero)["ok"]
    )  # equal, but not the same bytes
    assert not diff(a, a[::-1].copy())["ok"] and diff(a, a[::-1].copy())["max_abs_diff"] == 2.0
    assert diff(np.asfortranarray(np.eye(2)), np.eye(2))["ok"]  # the same values in another layout


def test_structure_and_non_finite_values_fail_under_any_tolerance():
    a = np.ones(3)
    for atol, rtol in ((0.0, 0.0), (1.0, 1.0)):
        assert not diff(a, a.astype(np.float32), atol, rtol)["ok"]
        assert not diff(a, np.ones(4), atol, rtol)["ok"]
        nan = np.array([np.nan, 1.0])
        assert diff(nan, nan.copy(), atol, rtol) == {
            "max_abs_diff": None,
            "ok": False,
            "detail": "1 non-finite values",
        }
    assert diff(a, a + 1e-9, 1e-6, 0.0)["ok"] and not diff(a, a + 1e-9)["ok"]


def test_json_values_compare_by_type_and_value():
    assert diff(3, 3)["ok"] and diff(None, None)["ok"] and diff("x", "x")["ok"]
    assert not diff(3, 3.0)["ok"] and not diff(True, 1)["ok"] and not diff([1, 2], (1, 2))["ok"]
    assert not diff(0.0, -0.0)["ok"] and not diff(0.1 + 0.2, 0.3)["ok"]
    assert not diff(2**100, 2**100 + 1)["ok"]  # a PCG64 state, never rounded through a float


def test_a_key_on_one_side_only_is_a_difference():
    r = compare({"model/w": np.zeros(1)}, {"model/v": np.zeros(1)})
    assert {k: v["detail"] for k, v in r.items()} == {
        "model/v": "missing on one side",
        "model/w": "missing on one side",
    }
    assert (
        compare({"progress/ended": None}, {})["progress/ended"]["ok"] is False
    )  # None is a value, not absence


def test_first_difference_names_the_path():
    tree = {"optimizer": {"t": 3, "exp_avg": {"w": np.arange(3.0)}}, "progress": {"ended": None}}
    same = {"optimizer": {"t": 3, "exp_avg": {"w": np.arange(3.0)}}, "progress": {"ended": None}}
    assert first_difference(tree, same) is None
    moved = {
        "optimizer": {"t": 3, "exp_avg": {"w": np.arange(3.0) + 1}},
        "progress": {"ended": None},
    }
    assert first_difference(tree, moved) == "optimizer/exp_avg/w: values differ, by up to 1.0"
    assert (
        first_difference(
            tree["optimizer"], {"t": 4, "exp_avg": tree["optimizer"]["exp_avg"]}, "optimizer"
        )
        == "optimizer/t: 3 vs 4"
    )
    assert (
        first_difference(np.zeros(2), np.ones(2), "losses") == "losses: values differ, by up to 1.0"
    )


def test_every_state_machine_is_named_from_the_one_list():
    assert {machine(f"{p}/x") for p in PARTS} == set(PARTS)
    assert machine("eval/losses") == "model" and machine("records/ids") == "data_iter"
