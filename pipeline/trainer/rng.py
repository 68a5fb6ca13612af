"""Named random streams derived from one seed; their states round-trip through JSON."""

from __future__ import annotations

import copy
import random
import zlib

import numpy as np

from pipeline.data.iterator import restore_stream, stream_state

# Every random draw in a run comes from one of these; nothing touches global np.random or random.
NUMPY_STREAMS, PYTHON_STREAMS = ("init", "data_order", "noise", "dropout"), ("python",)


class Streams:
    """The run's RNG streams: numpy PCG64 generators and a Python random.Random, by name."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        # a stable per-name key (crc32, not hash(): hash() is salted per process)
        key = {n: (zlib.crc32(n.encode()),) for n in (*NUMPY_STREAMS, *PYTHON_STREAMS)}
        child = {n: np.random.SeedSequence(entropy=self.seed, spawn_key=k) for n, k in key.items()}
        self.np = {n: np.random.Generator(np.random.PCG64(child[n])) for n in NUMPY_STREAMS}
        py_seeds = {n: int(child[n].generate_state(1, np.uint64)[0]) for n in PYTHON_STREAMS}
        self.py = {n: random.Random(s) for n, s in py_seeds.items()}

    def __getitem__(self, name: str):
        return self.np[name] if name in self.np else self.py[name]

    def names(self) -> list[str]:
        return [*self.np, *self.py]

    def state_dict(self) -> dict:
        return {n: stream_state(self[n]) for n in self.names()}

    def check_state_dict(self, state: dict) -> None:
        """Decode every stream onto a scratch generator: the live ones stay untouched if one is bad."""
        for n in self.names():
            try:
                restore_stream(copy.deepcopy(self[n]), state[n])
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"stream {n!r}: {e}") from None

    def load_state_dict(self, state: dict) -> None:
        if missing := set(self.names()) ^ set(state):
            raise KeyError(f"RNG streams differ: {sorted(missing)}")
        for n in self.names():
            restore_stream(self[n], state[n])

    def peek(self) -> dict[str, float]:
        """The next draw of every stream, drawn from a copy so the run is not disturbed."""
        return {n: float(copy.deepcopy(self[n]).random()) for n in self.names()}
