"""The state protocol (pipeline/stateful.py): one capture, arrays split from JSON and merged back, and a
two-phase restore that changes nothing unless every part fits."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.stateful import (
    PARTS,
    StateMismatch,
    capture,
    copy_tree,
    flat,
    merge,
    misfit,
    restore,
    split,
)


class Part:
    def __init__(self, **state):
        self.state = state
        self.loaded = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def test_split_and_merge_are_inverse():
    tree = {
        "model": {"w": np.arange(3.0)},
        "optimizer": {"t": 3, "exp_avg": {"w": np.ones(3)}},
        "progress": {"step": 3, "metrics": {"train/loss": 1.5}},
        "rng": {"a": {"state": "123"}},
    }
    arrays, json_tree = split(tree)
    assert set(arrays) == {"model/w", "optimizer/exp_avg/w"}
    assert json_tree == {
        "model": {},
        "optimizer": {"t": 3, "exp_avg": {}},
        "progress": tree["progress"],
        "rng": tree["rng"],
    }
    back = merge(arrays, json_tree)
    assert (
        back["optimizer"]["exp_avg"]["w"] is arrays["optimizer/exp_avg/w"]
        and back["progress"] == tree["progress"]
    )
    with pytest.raises(ValueError, match="keys on the way to an array"):
        split({"model": {"a/b": np.zeros(1)}})
    with pytest.raises(ValueError, match="both an array and a JSON value"):
        merge({"optimizer/t": np.zeros(1)}, {"optimizer": {"t": 1}})


def test_capture_is_live_and_copy_tree_is_not():
    a = np.zeros(2)
    parts = {p: Part() for p in PARTS}
    parts["model"] = Part(w=a)
    tree = capture(parts)
    assert tree["model"]["w"] is a
    copied = copy_tree(tree)
    assert copied["model"]["w"] is not a and np.array_equal(copied["model"]["w"], a)


@pytest.mark.parametrize(
    "live, got, words",
    [
        ({"w": np.zeros(2)}, {"w": np.zeros(3)}, "float64[3]"),
        ({"w": np.zeros(2)}, {"w": np.zeros(2, np.float32)}, "float32"),
        ({"w": np.zeros(2)}, {"w": [0.0, 0.0]}, "expected an array"),
        ({"a": 1, "b": 2}, {"a": 1}, "lacks ['b']"),
        ({"a": 1}, {"a": 1, "z": 0}, "unexpected ['z']"),
        ({"t": 1}, {"t": "1"}, "expected int, got str"),
        ({"l": [1, 2]}, {"l": [1]}, "a list of 1"),
        ({"o": {"x": 1}}, {"o": 5}, "expected an object"),
    ],
)
def test_fit_reason_names_what_does_not_fit(live, got, words):
    assert words in misfit(live, got)[1]


def test_fit_allows_a_fresh_null_and_free_form_objects():
    assert misfit({"best": None}, {"best": 1.5}) is None
    assert misfit({"t": 1}, {"t": 2.0}) is None  # JSON numbers
    assert misfit({"metrics": {}}, {"metrics": {"val/loss": 1.0}}, free=("metrics",)) is None


def test_restore_is_all_or_nothing():
    parts = {p: Part(x=1) for p in PARTS}
    tree = {p: {"x": 2} for p in PARTS}
    tree["rng"] = {"x": "two"}  # the last part in restore order does not fit
    with pytest.raises(StateMismatch) as info:
        restore(parts, tree)
    assert info.value.part == "rng" and all(p.loaded is None for p in parts.values())
    tree["rng"] = {"x": 3}
    restore(parts, tree)
    assert all(p.loaded is not None for p in parts.values())


def test_a_parts_own_check_refuses_and_a_missing_part_is_named():
    class Checked(Part):
        def check_state_dict(self, state):
            if state["x"] < 0:
                raise ValueError("x is negative")

    parts = {p: Part(x=1) for p in PARTS}
    parts["scheduler"] = Checked(x=1)
    with pytest.raises(StateMismatch, match="scheduler: x is negative"):
        restore(parts, {**{p: {"x": 1} for p in PARTS}, "scheduler": {"x": -1}})
    with pytest.raises(StateMismatch, match="optimizer: missing"):
        restore(parts, {p: {"x": 1} for p in PARTS if p != "optimizer"})


def test_flat_paths():
    assert flat({"a": {"b": 1, "c": {}}, "d": np.zeros(1)})["a/b"] == 1
    assert set(flat({"a": {"b": 1, "c": {}}})) == {"a/b", "a/c"}
