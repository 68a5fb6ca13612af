"""A data iterator whose whole state is (epoch, permutation, cursor): it stops and continues mid-epoch."""
from __future__ import annotations

import numpy as np


class DataIterator:
    """Yields batches of sample ids, each id exactly once per epoch, reshuffled from its own generator.

    A final partial batch is dropped (drop_last) so every step sees the same batch shape.
    """

    def __init__(self, n: int, batch_size: int, rng: np.random.Generator):
        if batch_size > n:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} training samples")
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
        # The generator's own state lives with the run's RNG streams (data_order).
        return {"epoch": self.epoch, "permutation": self.permutation.copy(), "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        perm = np.asarray(state["permutation"])
        if perm.shape != (self.n,):
            raise ValueError(f"permutation has shape {perm.shape}, expected ({self.n},)")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.permutation = perm.astype(np.int64).copy()
