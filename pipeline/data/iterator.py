"""The data iterator; its state, (epoch, cursor) and its epoch's start in the data-order stream, is a few integers."""

from __future__ import annotations

import random

import numpy as np

from pipeline.stateful import BadValue


class DataIterator:
    """Batches of sample ids from the data-order stream `rng`, `n // batch_size` an epoch (drop_last): offsets=0,
    each id once an epoch, in a permutation drawn at its start; else ids uniform in [0, offsets) (nanoGPT's)."""

    free_form_state = ("",)  # two forms (afe8033's held the permutation): both checked here

    def __init__(self, n: int, batch_size: int, rng: np.random.Generator, offsets: int = 0):
        if not 1 <= batch_size <= n:
            why = f"trainer.batch_size={batch_size}: must be between 1 and the {n} training samples"
            raise ValueError(why)
        self.n, self.batch_size, self.rng, self.offsets = int(n), int(batch_size), rng, int(offsets)
        self.epoch, self.cursor, self.batches_per_epoch = 0, 0, self.n // self.batch_size
        self._begin_epoch(self.rng)

    def _begin_epoch(self, g: np.random.Generator) -> None:
        # start: g's state (the stream's, or a checkpoint's) before the epoch's permutation (None: loaded whole)
        self.start: dict | None = stream_state(g)
        self.permutation = None if self.offsets else g.permutation(self.n).astype(np.int64)

    def next_ids(self) -> np.ndarray:
        if self.cursor + self.batch_size > self.n:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._begin_epoch(self.rng)
        if self.permutation is None:
            ids = self.rng.integers(0, self.offsets, size=self.batch_size, dtype=np.int64)
        else:
            ids = self.permutation[self.cursor : self.cursor + self.batch_size].copy()  # [B]
        self.cursor += self.batch_size
        return ids

    def state_dict(self) -> dict:  # the generator's own state: the run's RNG streams (data_order)
        if self.start is None:  # an epoch a checkpoint of afe8033's form began: saved as it came
            return {"epoch": self.epoch, "permutation": self.permutation, "cursor": self.cursor}
        return {"epoch": self.epoch, "cursor": self.cursor, "start": dict(self.start)}

    def legacy_state(self) -> dict:
        """The state as afe8033 saved it (its arrays' layout is what the checkpoint's file may hold)."""
        return {"epoch": 0, "permutation": np.zeros(self.n, dtype=np.int64), "cursor": 0}

    def check_state_dict(self, state: dict) -> None:
        keys = {"epoch", "cursor", "permutation" if "permutation" in state else "start"}
        if odd := sorted(set(state) ^ keys):
            raise BadValue(odd[0], f"keys {sorted(state)}: expected {sorted(keys)}")
        if "permutation" in state:
            perm = state["permutation"]
            if not isinstance(perm, np.ndarray) or perm.dtype.kind not in "iu":
                raise BadValue("permutation", "permutation is not an array of sample ids")
            if not np.array_equal(np.sort(perm), np.arange(self.n)):
                why = f"permutation is not a permutation of the {self.n} sample ids"
                raise BadValue("permutation", why)
        else:
            try:
                if set(state["start"]) != set(stream_state(self.rng)):
                    raise KeyError(sorted(state["start"]))
                restore_stream(np.random.default_rng(), state["start"])
            except (TypeError, ValueError, KeyError) as e:
                raise BadValue("start", f"start is not a data-order stream's state: {e}") from None
        epoch, cursor = state["epoch"], state["cursor"]
        if not (type(epoch) is type(cursor) is int and 0 <= cursor <= self.n and epoch >= 0):
            raise BadValue("cursor", f"cursor {cursor} or epoch {epoch} out of range (n={self.n})")

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        if "permutation" in state:
            self.start, self.permutation = None, np.array(state["permutation"], dtype=np.int64)
            return
        restore_stream(g := np.random.default_rng(), state["start"])
        self._begin_epoch(g)  # the permutation drawn again from the epoch's start


def stream_state(g: np.random.Generator | random.Random) -> dict:
    """A stream's state as JSON: a PCG64's (its 128-bit ints as strings: exact in any JSON reader) or a random's."""
    if isinstance(g, random.Random):
        version, internal, gauss_next = g.getstate()
        return {"version": version, "internal": list(internal), "gauss_next": gauss_next}
    s = g.bit_generator.state
    if s["bit_generator"] != "PCG64":
        raise TypeError(f"unsupported bit generator {s['bit_generator']}")
    big, small = {k: str(s["state"][k]) for k in _BIG}, {k: int(s[k]) for k in _SMALL}
    return {"bit_generator": "PCG64", **big, **small}


def restore_stream(g: np.random.Generator | random.Random, d: dict) -> None:
    """`g` put in the state `d` stream_state gave (a TypeError, ValueError or KeyError if it is none)."""
    if isinstance(g, random.Random):
        g.setstate((int(d["version"]), tuple(int(v) for v in d["internal"]), d["gauss_next"]))
    else:
        big, small = ({k: int(d[k]) for k in keys} for keys in (_BIG, _SMALL))
        g.bit_generator.state = {"bit_generator": d["bit_generator"], "state": big, **small}


_BIG, _SMALL = ("state", "inc"), ("has_uint32", "uinteger")  # PCG64's 128-bit and its small ints
