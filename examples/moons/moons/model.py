"""A radial-basis-function network: K Gaussian bumps with learned centers and widths, dropout, a softmax head."""

from __future__ import annotations

import numpy as np

from pipeline.data.base import Batch, DataSpec
from pipeline.model.base import NamedParams


def softmax_cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    # logits [B, C], y [B] int -> mean loss, dlogits [B, C]
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)  # [B, C]
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y]).mean())
    p[np.arange(n), y] -= 1.0
    return loss, p / n


class RBFNet(NamedParams):
    """phi_k(x) = exp(-gamma_k |x - c_k|^2), gamma_k = exp(log_gamma_k); logits = dropout(phi) @ W + b.

    The Model protocol: `needs`, `params` (unique arrays by name, updated in place by the optimizer; state_dict
    and load_state_dict come from NamedParams), `loss_and_grads(batch, rng)` with dropout drawn from `rng` (the
    run's dropout stream), and `evaluate(batch)` (no dropout, no draws).
    """

    needs = "classes"

    def __init__(
        self,
        spec: DataSpec,
        n_centers: int,
        dropout: float,
        init_scale: float,
        dtype: str,
        rng: np.random.Generator | None,
    ):
        if not (spec.n_features and spec.n_targets):
            raise ValueError("model RBFNet needs rows of features with a class (e.g. data=moons)")
        if n_centers < 1 or not 0.0 <= dropout < 1.0:
            raise ValueError(
                f"model.n_centers={n_centers} must be >= 1 and model.dropout={dropout} in [0, 1)"
            )
        if rng is None:
            raise ValueError("RBFNet needs rng (the run's init stream) to initialise its weights")
        self.dropout, self.dtype = float(dropout), np.dtype(dtype)
        K, D, C = int(n_centers), spec.n_features, spec.n_targets
        self.params = {  # drawn in this order from the init stream
            "rbf.centers": rng.normal(0.0, init_scale, (K, D)).astype(self.dtype),  # [K, D]
            "rbf.log_gamma": np.zeros(K, dtype=self.dtype),  # [K]
            "head.weight": rng.normal(0.0, 0.1, (K, C)).astype(self.dtype),  # [K, C]
            "head.bias": np.zeros(C, dtype=self.dtype),  # [C]
        }

    def forward(self, x: np.ndarray, rng: np.random.Generator | None):
        # x [B, D] -> logits [B, C], cache; rng None: eval mode (no dropout, no draws)
        c, g = self.params["rbf.centers"], np.exp(self.params["rbf.log_gamma"])  # [K, D], [K]
        diff = x[:, None, :] - c[None, :, :]  # [B, K, D]
        d2 = (diff * diff).sum(axis=2)  # [B, K]
        phi = np.exp(-g * d2)  # [B, K]
        mask = None
        if rng is not None and self.dropout > 0:
            mask = (rng.random(phi.shape) >= self.dropout) / self.dtype.type(
                1.0 - self.dropout
            )  # [B, K]
        h = phi if mask is None else phi * mask  # [B, K]
        logits = h @ self.params["head.weight"] + self.params["head.bias"]  # [B, C]
        return logits, (diff, d2, phi, g, mask, h)

    def backward(self, dlogits: np.ndarray, cache) -> dict[str, np.ndarray]:
        diff, d2, phi, g, mask, h = cache
        dW = h.T @ dlogits  # [K, C]
        db = dlogits.sum(axis=0)  # [C]
        dh = dlogits @ self.params["head.weight"].T  # [B, K]
        dphi = dh if mask is None else dh * mask  # [B, K]
        dexp = dphi * phi  # [B, K]: d loss / d(-g * d2)
        dlog_gamma = -(dexp * d2).sum(axis=0) * g  # [K]: through g = exp(log_gamma)
        dd2 = -dexp * g  # [B, K]
        dcenters = -2.0 * (dd2[:, :, None] * diff).sum(axis=0)  # [K, D]: d(d2)/dc = -2 (x - c)
        return {
            "rbf.centers": dcenters,
            "rbf.log_gamma": dlog_gamma,
            "head.weight": dW,
            "head.bias": db,
        }

    def loss_and_grads(self, batch: Batch, rng: np.random.Generator | None):
        logits, cache = self.forward(batch.x, rng)
        loss, dlogits = softmax_cross_entropy(logits, batch.y)
        return loss, self.backward(dlogits, cache)

    def evaluate(self, batch: Batch) -> float:
        return softmax_cross_entropy(self.forward(batch.x, None)[0], batch.y)[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x, None)[0].argmax(axis=1)  # [B]
