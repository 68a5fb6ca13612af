"""Seed 003's regression set: 24 rows, two inputs, one target; a fixed synthetic relation plus noise."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np

from pipeline.data.base import Batch, DataSpec


class Regression:
    """Trains on all rows, evaluates on them unaugmented; a training batch gets a gain from the Python stream and
    Gaussian input noise from the noise stream, so an unrestored RNG shows (the verifier's negative control)."""

    kind = "rows"
    baselines = ()  # baseline_metrics gives none

    def __init__(self, n_rows: int, seed: int, noise: float, input_gain: float, input_noise: float):
        self.params = {"name": "regression", "n_rows": n_rows, "seed": seed, "noise": noise}
        g = np.random.default_rng(seed)  # a local generator: the rows depend on the params alone
        x = g.uniform(-1.0, 1.0, size=(n_rows, 2))  # [N, 2]
        y = np.sin(2.0 * x[:, :1]) + 0.5 * x[:, 1:] ** 2 - 0.3 * x[:, :1] * x[:, 1:]  # [N, 1]
        self.x, self.y = x, y + noise * g.normal(size=y.shape)
        self.input_gain, self.input_noise = float(input_gain), float(input_noise)
        self.spec, self.n_train = DataSpec(n_features=2, n_targets=1), n_rows
        sha = {k: hashlib.sha256(getattr(self, k).tobytes()).hexdigest() for k in ("x", "y")}
        manifest = json.dumps({**self.params, "sha256": sha}, sort_keys=True)
        self.manifest_hash = hashlib.sha256(manifest.encode()).hexdigest()

    def train_batch(self, ids: np.ndarray, dtype) -> Batch:
        return Batch(ids=ids, x=self.x[ids].astype(dtype), y=self.y[ids].astype(dtype))

    def augment(self, batch: Batch, streams) -> Batch:
        x = batch.x
        if self.input_gain:
            x = x * x.dtype.type(1.0 + streams["python"].uniform(-self.input_gain, self.input_gain))
        if self.input_noise:
            x = x + streams["noise"].normal(0.0, self.input_noise, size=x.shape).astype(x.dtype)
        return Batch(ids=batch.ids, x=x, y=batch.y)

    def val_batches(self, dtype) -> Iterator[Batch]:
        yield Batch(ids=np.arange(self.n_train), x=self.x.astype(dtype), y=self.y.astype(dtype))

    def baseline_metrics(self) -> dict[str, float]:
        return {}
