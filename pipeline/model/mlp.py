"""A multilayer perceptron with explicit forward and backward over named arrays, and inverted dropout."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from pipeline.data.base import Batch, DataSpec
from pipeline.model.base import NamedParams
from pipeline.model.losses import mse

# name -> (the activation, its derivative as a function of its output)
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "tanh": (np.tanh, lambda h: 1 - h * h),
    "relu": (lambda z: z * (z > 0), lambda h: h > 0),
}


class MLP(NamedParams):
    """in -> hidden... -> out; activation and dropout after every hidden layer; MSE loss.
    loss_and_grads only reads params and returns fresh arrays: safe to run concurrently (Shards)."""

    needs = "rows"  # the data kind it trains on

    def __init__(self, spec: DataSpec, hidden: list[int], activation: str, dropout: float, dtype: str,
                 rng: np.random.Generator):  # fmt: skip
        # validated (config/schemas.py) and paired with the data (run/assemble.py check_pairing) first
        (self.activation, self.derivative), self.dropout = ACTIVATIONS[activation], float(dropout)
        self.dtype, self.n_layers = np.dtype(dtype), len(hidden) + 1
        widths = [spec.n_features, *hidden, spec.n_targets]
        self.params: dict[str, np.ndarray] = {}
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            # torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
            u = 1.0 / np.sqrt(fan_in)
            for name, shape in (("weight", (fan_in, fan_out)), ("bias", (fan_out,))):
                self.params[f"layers.{i}.{name}"] = rng.uniform(-u, u, shape).astype(self.dtype)

    @staticmethod
    def n_params(spec: DataSpec, hidden: list[int], **_) -> int:
        """The parameter count __init__ would allocate, computed without allocating it."""
        widths = [int(spec.n_features), *map(int, hidden), int(spec.n_targets)]
        return sum((a + 1) * b for a, b in itertools.pairwise(widths))

    def forward(self, x: np.ndarray, rng: np.random.Generator | None = None):
        # x [B, in] -> out [B, out]; rng None means eval mode (no dropout, no draws)
        caches, h = [], x
        for i in range(self.n_layers):
            caches.append(cache := {"x": h})
            h = h @ self.params[f"layers.{i}.weight"] + self.params[f"layers.{i}.bias"]
            if i < self.n_layers - 1:
                h = cache["h"] = self.activation(h)
                if rng is not None and self.dropout > 0:
                    keep = (rng.random(h.shape) >= self.dropout).astype(self.dtype)  # [B, fan_out]
                    cache["mask"] = keep / self.dtype.type(1 - self.dropout)
                    h = h * cache["mask"]
        return h, caches

    def backward(self, dout: np.ndarray, caches) -> dict[str, np.ndarray]:
        grads, dh = {}, dout
        for i, cache in reversed(list(enumerate(caches))):
            if "mask" in cache:
                dh = dh * cache["mask"]
            if "h" in cache:
                dh = dh * self.derivative(cache["h"])
            grads[f"layers.{i}.weight"] = cache["x"].T @ dh  # [fan_in, fan_out]
            grads[f"layers.{i}.bias"] = dh.sum(axis=0)
            dh = dh @ self.params[f"layers.{i}.weight"].T  # [B, fan_in]
        return {k: grads[k] for k in self.params}

    def loss_and_grads(self, batch: Batch, rng: np.random.Generator | None):
        pred, caches = self.forward(batch.x, rng)
        loss, dpred = mse(pred, batch.y)
        return loss, self.backward(dpred, caches)

    def evaluate(self, batch: Batch) -> float:
        return mse(self.forward(batch.x, None)[0], batch.y)[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x, None)[0]
