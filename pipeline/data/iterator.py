"""A data iterator whose whole state is (epoch, permutation, cursor): it stops and continues mid-epoch."""

from __future__ import annotations

import numpy as np

from pipeline.stateful import BadValue


class DataIterator:
    """Yields batches of sample ids, each id exactly once per epoch, reshuffled from its own generator.

    A final partial batch is dropped (drop_last) so every step sees the same batch shape.
    """

    def __init__(self, n: int, batch_size: int, rng: np.random.Generator):
        if not 1 <= batch_size <= n:
            raise ValueError(
                f"trainer.batch_size={batch_size}: must be between 1 and the {n} training samples"
            )
        self.n, self.batch_size, self.rng = int(n), int(batch_size), rng
        self.epoch = 0
        self.permutation = rng.permutation(self.n).astype(np.int64)  # [n]
        self.cursor = 0

    def next_ids(self) -> np.ndarray:
        if self.cursor + self.batch_size > self.n:
            self.epoch += 1
            self.permutation = self.rng.permutation(self.n).astype(np.int64)
            self.cursor = 0
        ids = self.permutation[self.cursor : self.cursor + self.batch_size].copy()  # [B]
        self.cursor += self.batch_size
        return ids

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def state_dict(self) -> dict:
        # The generator's own state lives with the run's RNG streams (data_order). Live objects, not copies.
        return {"epoch": self.epoch, "permutation": self.permutation, "cursor": self.cursor}

    def check_state_dict(self, state: dict) -> None:
        perm = state["permutation"]
        if perm.dtype.kind not in "iu" or not np.array_equal(np.sort(perm), np.arange(self.n)):
            raise BadValue(
                "permutation", f"permutation is not a permutation of the {self.n} sample ids"
            )
        if not (0 <= state["cursor"] <= self.n and state["epoch"] >= 0):
            raise BadValue(
                "cursor",
                f"cursor {state['cursor']} or epoch {state['epoch']} out of range (n={self.n})",
            )

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.permutation = np.array(state["permutation"], dtype=np.int64, copy=True)
