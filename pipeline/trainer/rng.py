"""Named random streams derived from one seed; their states round-trip through JSON."""

from __future__ import annotations

import random
import zlib

import numpy as np

from pipeline.data.iterator import numpy_state_from_json, numpy_state_to_json

# Every random draw in a run comes from one of these; nothing touches global np.random or random.
NUMPY_STREAMS = ("init", "data_order", "noise", "dropout")
PYTHON_STREAMS = ("python",)


def _child_seed(seed: int, name: str) -> np.random.SeedSequence:
    # A stable per-name key (crc32, not hash(): hash() is salted per process).
    return np.random.SeedSequence(entropy=seed, spawn_key=(zlib.crc32(name.encode()),))


class Streams:
    """The run's RNG streams: numpy PCG64 generators and a Python random.Random, by name."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.np = {
            n: np.random.Generator(np.random.PCG64(_child_seed(self.seed, n)))
            for n in NUMPY_STREAMS
        }
        self.py = {
            n: random.Random(int(_child_seed(self.seed, n).generate_state(1, np.uint64)[0]))
            for n in PYTHON_STREAMS
        }

    def __getitem__(self, name: str):
        return self.np[name] if name in self.np else self.py[name]

    def names(self) -> list[str]:
        return [*self.np, *self.py]

    def state_dict(self) -> dict:
        return {
            **{n: numpy_state_to_json(g) for n, g in self.np.items()},
            **{n: python_state_to_json(r) for n, r in self.py.items()},
        }

    def check_state_dict(self, state: dict) -> None:
        """Decode every stream onto a scratch generator: the live ones stay untouched if one is bad."""
        for n in self.names():
            try:
                if n in self.np:
                    np.random.PCG64().state = numpy_state_from_json(state[n])
                else:
                    random.Random().setstate(python_state_from_json(state[n]))
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"stream {n!r}: {e}") from None

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.names()) ^ set(state)
        if missing:
            raise KeyError(f"RNG streams differ: {sorted(missing)}")
        for n, g in self.np.items():
            g.bit_generator.state = numpy_state_from_json(state[n])
        for n, r in self.py.items():
            r.setstate(python_state_from_json(state[n]))

    def peek(self) -> dict[str, float]:
        """The next draw of every stream, with each state put back so the run is not disturbed."""
        out = {}
        for n, g in self.np.items():
            saved, out[n] = g.bit_generator.state, float(g.random())
            g.bit_generator.state = saved
        for n, r in self.py.items():
            kept, out[n] = r.getstate(), r.random()
            r.setstate(kept)
        return out


def python_state_to_json(r: random.Random) -> dict:
    version, internal, gauss_next = r.getstate()
    return {"version": version, "internal": list(internal), "gauss_next": gauss_next}


def python_state_from_json(d: dict) -> tuple:
    return (int(d["version"]), tuple(int(v) for v in d["internal"]), d["gauss_next"])
