"""Losses as pure functions returning the loss and its gradient with respect to the prediction."""

from __future__ import annotations

import numpy as np


def mse(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    # pred, target: [B, k] -> loss (mean over all elements), dpred [B, k]
    diff = pred - target
    return float(np.mean(diff * diff)), (2.0 / diff.size) * diff


# exp needs no shift while every logit is within this of 0: exp(64) * V stays far below float32's max
# (3.4e38) for any V under 1e10, and exp(-64) far above its smallest normal, so no row sum overflows or vanishes.
_UNSHIFTED_RANGE = 64.0


def cross_entropy(logits: np.ndarray, targets: np.ndarray, overwrite: bool = False):
    # logits [N, V] float, targets [N] int -> loss (mean over N), dlogits [N, V] = (softmax - onehot) / N.
    # overwrite=True turns logits into dlogits in place (for a caller done with them): no [N, V] temporary.
    loss, d, row_scale = cross_entropy_factored(logits if overwrite else logits.copy(), targets)
    d *= row_scale[:, None]  # [N, V]
    return loss, d


def cross_entropy_factored(logits: np.ndarray, targets: np.ndarray):
    # logits [N, V] float (overwritten), targets [N] int -> loss, d [N, V] in logits' memory, row_scale [N] with
    # dlogits = d * row_scale[:, None]: a caller linear in dlogits next (the tied head) scales its [N, d] operands.
    n, V = logits.shape
    z, rows = logits, np.arange(n)  # z [N, V], overwritten
    if not -_UNSHIFTED_RANGE <= z.min() <= z.max() <= _UNSHIFTED_RANGE:
        # Out of range: shift each row by its max. Within it the shift is skipped (softmax is shift invariant and
        # exp's relative error does not depend on it): two whole-array reductions, not a row max and an [N, V] pass.
        z -= z.max(axis=1, keepdims=True)  # [N, V] shifted: exp cannot overflow
    picked = z[rows, targets]  # [N] (shifted) logit of each target
    np.exp(z, out=z)  # [N, V]
    sumexp = z @ np.ones(V, dtype=z.dtype)  # [N] row sums as one gemv, ~4x faster than .sum(1)
    loss = float(np.mean(np.log(sumexp) - picked))  # -log softmax at the targets; any shift cancels
    z[rows, targets] -= sumexp  # [N, V] e - onehot * sum(e)
    # (e - onehot * sum(e)) / (N sum(e)) = (softmax - onehot) / N
    return loss, z, (1.0 / n) / sumexp
