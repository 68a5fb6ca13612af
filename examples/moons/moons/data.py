"""Two interleaved half-moons in the plane, two classes: generated once from `seed`, jittered while training."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np

from pipeline.data.base import Batch, DataSpec


def make_moons(n: int, noise: float, g: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    # -> x [n, 2] float64, y [n] int64: class 0 the upper moon, class 1 the lower one, shifted into it
    y = g.integers(0, 2, size=n)  # [n]
    angle = g.uniform(0.0, np.pi, size=n)  # [n]
    x = np.stack([np.cos(angle), np.sin(angle)], axis=1)  # [n, 2]
    x[y == 1] = np.array([1.0, 0.5]) - x[y == 1]  # the lower moon: reflected and shifted
    return x + noise * g.normal(size=x.shape), y.astype(np.int64)


class TwoMoons:
    """The Dataset protocol: `kind`, `spec`, `n_train`, `manifest_hash`, `train_batch`, `augment`,
    `val_batches`, `baseline_metrics`.

    The points are a pure function of the constructor's arguments (a local generator seeded with `seed`, not
    one of the run's streams); training batches get Gaussian jitter from the run's `noise` stream, so an
    unrestored RNG shows in the trajectory (the verifier's negative control needs that).
    """

    kind = "classes"  # rows of features with an integer class: what RBFNet.needs

    def __init__(self, n_train: int, n_val: int, noise: float, jitter: float, seed: int):
        if n_train < 1 or n_val < 1:
            raise ValueError(f"data.n_train={n_train} and data.n_val={n_val}: each must be >= 1")
        if noise < 0 or jitter < 0:
            raise ValueError(f"data.noise={noise} and data.jitter={jitter}: each must be >= 0")
        g = np.random.default_rng(seed)
        self.x, self.y = make_moons(n_train + n_val, float(noise), g)  # [N, 2], [N]
        self.n_train, self.jitter = int(n_train), float(jitter)
        self.spec = DataSpec(n_features=2, n_targets=2)
        params = {"name": "moons", "n_train": n_train, "n_val": n_val, "noise": noise, "seed": seed}
        digest = {
            "x": hashlib.sha256(self.x.tobytes()).hexdigest(),
            "y": hashlib.sha256(self.y.tobytes()).hexdigest(),
        }
        described = json.dumps({**params, "sha256": digest}, sort_keys=True).encode()
        self.manifest_hash = hashlib.sha256(described).hexdigest()

    def train_batch(self, ids: np.ndarray, dtype) -> Batch:
        return Batch(ids=ids, x=self.x[ids].astype(dtype), y=self.y[ids])  # x [B, 2], y [B]

    def augment(self, batch: Batch, streams) -> Batch:
        if not self.jitter:
            return batch
        noise = (
            streams["noise"].normal(0.0, self.jitter, size=batch.x.shape).astype(batch.x.dtype)
        )  # [B, 2]
        return Batch(ids=batch.ids, x=batch.x + noise, y=batch.y)

    def val_batches(self, dtype) -> Iterator[Batch]:
        ids = np.arange(self.n_train, len(self.y))
        yield Batch(ids=ids, x=self.x[ids].astype(dtype), y=self.y[ids])

    def baseline_metrics(self) -> dict[str, float]:
        return {}
