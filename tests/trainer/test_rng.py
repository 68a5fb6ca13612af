"""Named RNG streams: exact JSON round trip, independence between names, and a non-disturbing peek()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.trainer.rng import NUMPY_STREAMS, PYTHON_STREAMS, Streams

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def draws(streams: Streams, name: str, k: int = 6) -> list:
    """A mix of draw kinds, so every part of the state (incl. buffered uint32 / gauss_next) matters."""
    s = streams[name]
    if name in streams.np:
        return [
            float(s.random()),
            int(s.integers(0, 2**31, dtype=np.uint32)),
            float(s.normal()),
            int(s.integers(0, 2**63)),
            s.permutation(k).tolist(),
            float(s.standard_normal()),
        ]
    return [
        s.random(),
        s.gauss(0.0, 1.0),
        s.getrandbits(64),
        s.randrange(1000),
        s.gauss(0.0, 1.0),
        s.random(),
    ]


def advance(streams: Streams) -> None:
    """Leave every stream mid-way, with a buffered half-word / cached gauss where the kind has one."""
    for n in streams.names():
        draws(streams, n)
    for g in streams.np.values():
        g.integers(0, 2**31, dtype=np.uint32)  # PCG64 keeps the other 32 bits: has_uint32 = 1
    for r in streams.py.values():
        r.gauss(0.0, 1.0)  # random.Random caches the second normal: gauss_next is a float


def test_names():
    s = Streams(0)
    assert s.names() == [*NUMPY_STREAMS, *PYTHON_STREAMS]
    assert set(s.names()) >= {"init", "data_order", "noise", "dropout", "python"}
    with pytest.raises(KeyError, match="nope"):
        s["nope"]


def test_state_survives_json_exactly():
    s = Streams(1234)
    advance(s)
    state = s.state_dict()
    assert any(v.get("has_uint32") == 1 for v in state.values())  # the hard case is covered
    assert any(v.get("gauss_next") is not None for v in state.values())
    text = json.dumps(state)  # plain JSON: no custom encoder
    restored = Streams(99)  # a different seed: everything must come from the state
    restored.load_state_dict(json.loads(text))
    assert restored.state_dict() == state
    assert json.dumps(restored.state_dict()) == text
    for n in s.names():
        assert draws(restored, n) == draws(s, n), n


def test_numpy_state_keeps_128_bit_integers_exact():
    s = Streams(7)
    advance(s)
    for n in NUMPY_STREAMS:
        raw = s[n].bit_generator.state
        j = json.loads(json.dumps(s.state_dict()))[n]
        assert int(j["state"]) == raw["state"]["state"] and int(j["inc"]) == raw["state"]["inc"]
        assert (
            raw["state"]["state"] > 2**64 or raw["state"]["inc"] > 2**64
        )  # really beyond a double/int64


def test_load_state_dict_rejects_missing_or_extra_streams():
    state = Streams(0).state_dict()
    with pytest.raises(KeyError, match=r"RNG streams differ: \['noise'\]"):
        Streams(0).load_state_dict({k: v for k, v in state.items() if k != "noise"})
    with pytest.raises(KeyError, match=r"RNG streams differ: \['extra'\]"):
        Streams(0).load_state_dict({**state, "extra": state["noise"]})


def test_same_seed_same_streams_different_seed_different_streams():
    a, b, c = Streams(5), Streams(5), Streams(6)
    for n in a.names():
        da = draws(a, n)
        assert da == draws(b, n)
        assert da != draws(c, n)


def test_different_names_are_independent_streams():
    s = Streams(0)
    first = {n: [draws(s, n) for _ in range(3)] for n in NUMPY_STREAMS}
    names = list(first)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert first[a] != first[b], (a, b)
    # Drawing from one stream leaves every other stream's sequence untouched.
    for busy in s.names():
        ref, s2 = Streams(3), Streams(3)
        for _ in range(50):
            draws(s2, busy)
        for n in s.names():
            if n != busy:
                assert draws(s2, n) == draws(ref, n), (busy, n)


def test_streams_do_not_touch_global_random_state():
    import random

    np_state, py_state = np.random.get_state(), random.getstate()
    s = Streams(0)
    for n in s.names():
        draws(s, n)
    s.load_state_dict(json.loads(json.dumps(s.state_dict())))
    s.peek()
    assert random.getstate() == py_state
    g = np.random.get_state()
    assert g[0] == np_state[0] and np.array_equal(g[1], np_state[1]) and g[2:] == np_state[2:]


@pytest.mark.parametrize("advanced", [False, True], ids=["fresh", "advanced"])
def test_peek_does_not_disturb_the_streams(advanced):
    s, twin = Streams(11), Streams(11)
    if advanced:
        advance(s)
        advance(twin)
    before = s.state_dict()
    p1 = s.peek()
    p2 = s.peek()
    assert p1 == p2
    assert s.state_dict() == before
    assert set(p1) == set(s.names())
    # peek reports the actual next draw: random() on every stream
    for n in s.names():
        assert p1[n] == float(s[n].random()), n
    # and the streams then continue exactly like a twin that was never peeked
    for n in twin.names():
        twin[n].random()
    for n in s.names():
        assert draws(s, n) == draws(twin, n), n


def test_streams_are_the_same_in_another_process(tmp_path):
    """Per-name seeds must not depend on the process (e.g. on Python's salted hash())."""
    code = "import json; from pipeline.trainer.rng import Streams; print(json.dumps(Streams(2024).peek()))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(PROJECT_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(out.stdout) == Streams(2024).peek()
