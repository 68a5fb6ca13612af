"""Losses as pure functions returning the loss and its gradient with respect to the prediction."""
from __future__ import annotations

import numpy as np


def mse(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    # pred, target: [B, k] -> loss (mean over all elements), dpred [B, k]
    diff = pred - target
    loss = float(np.mean(diff * diff))
    return loss, (2.0 / diff.size) * diff


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    # logits [N, V] float, targets [N] int -> loss (mean over N), dlogits [N, V]
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    sumexp = exp.sum(axis=1, keepdims=True)  # [N, 1]
    logp_target = shifted[np.arange(n), targets] - np.log(sumexp[:, 0])
    loss = float(-logp_target.mean())
    dlogits = exp / sumexp
    dlogits[np.arange(n), targets] -= 1.0
    dlogits /= n
    return loss, dlogits
