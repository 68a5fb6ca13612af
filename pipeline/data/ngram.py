"""An interpolated modified Kneser-Ney n-gram language model over integer tokens, fitted with numpy."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Level:
    """Counts for one order k: k-grams and their (k-1)-token contexts, keys in base vocab_size."""

    keys: np.ndarray  # [G] int64 sorted k-gram keys
    counts: np.ndarray  # [G] float64 raw counts (top order) or continuation counts (lower orders)
    ctx_keys: np.ndarray  # [C] int64 sorted context keys (all 0 for k=1: the empty context)
    ctx_total: np.ndarray  # [C] float64 sum of counts after the context
    ctx_backoff: np.ndarray  # [C] float64 D1*N1 + D2*N2 + D3*N3+: the mass discounting freed
    discounts: tuple[float, float, float]  # D1, D2, D3+


@dataclass(frozen=True)
class KneserNey:
    order: int
    vocab_size: int
    levels: tuple[Level, ...]  # levels[k-1] holds order k


def max_order(vocab_size: int) -> int:
    # A key packs k tokens in base V into an int64.
    return max(1, int(63 // math.log2(max(vocab_size, 2))))


def _keys(tokens: np.ndarray, k: int, V: int) -> np.ndarray:
    # tokens [N] -> [N-k+1] keys of every k-gram
    n = len(tokens) - k + 1
    key = np.zeros(max(n, 0), dtype=np.int64)
    for j in range(k):
        key = key * V + tokens[j : j + n]
    return key


FALLBACK = (0.5, 1.0, 1.5)  # KenLM's --discount_fallback


def _discounts(counts: np.ndarray) -> tuple[float, float, float]:
    # Chen & Goodman's estimates from the count-of-counts, clipped so no count goes negative.
    n1, n2, n3, n4 = (float(np.count_nonzero(counts == c)) for c in (1, 2, 3, 4))
    if n1 == 0 or n2 == 0:
        return FALLBACK  # too little data for the estimate
    y = n1 / (n1 + 2 * n2)
    d1 = 1 - 2 * y * n2 / n1
    d2 = 2 - 3 * y * n3 / n2
    d3 = 3 - 4 * y * n4 / n3 if n3 > 0 else 2.0
    return float(np.clip(d1, 0, 1)), float(np.clip(d2, 0, 2)), float(np.clip(d3, 0, 3))


def _level(keys: np.ndarray, counts: np.ndarray, V: int) -> Level:
    ctx = keys // V
    ctx_keys, start = np.unique(ctx, return_index=True)  # keys are sorted, so contexts are runs

    def backoff(d):
        return np.add.reduceat(np.where(counts == 1, d[0], np.where(counts == 2, d[1], d[2])), start)

    d = _discounts(counts)
    ctx_backoff = backoff(d)
    if not np.all(ctx_backoff > 0):
        # An estimate clipped to 0 (tiny data) would leave a context no mass for the tokens never seen
        # after it: they would get probability 0 (an infinite perplexity). The fallback discounts are > 0.
        d = FALLBACK
        ctx_backoff = backoff(d)
    return Level(keys=keys, counts=counts, ctx_keys=ctx_keys, ctx_total=np.add.reduceat(counts, start),
                 ctx_backoff=ctx_backoff, discounts=d)


def fit(tokens: np.ndarray, order: int, vocab_size: int) -> KneserNey:
    """Fit on one token stream [N]; lower orders use Kneser-Ney continuation counts."""
    tokens = np.asarray(tokens, dtype=np.int64)
    V = int(vocab_size)
    if not 1 <= order <= max_order(V):
        raise ValueError(f"n-gram order {order} must be in [1, {max_order(V)}] for vocab size {V}")
    if len(tokens) < order:
        raise ValueError(f"{len(tokens)} tokens are too few to fit an order-{order} n-gram")
    levels = []
    for k in range(1, order + 1):
        if k == order:
            keys, counts = np.unique(_keys(tokens, k, V), return_counts=True)
        else:
            # Continuation count: how many distinct tokens precede this k-gram.
            ext = np.unique(_keys(tokens, k + 1, V))
            keys, counts = np.unique(ext % V**k, return_counts=True)
        levels.append(_level(keys, counts.astype(np.float64), V))
    return KneserNey(order=int(order), vocab_size=V, levels=tuple(levels))


def _lookup(sorted_keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    # values[i] where sorted_keys[i] == query, else 0
    i = np.searchsorted(sorted_keys, query)
    i = np.minimum(i, len(sorted_keys) - 1)
    hit = sorted_keys[i] == query
    return np.where(hit, values[i], 0.0)


def _discount_of(level: Level, counts: np.ndarray) -> np.ndarray:
    d1, d2, d3 = level.discounts
    return np.where(counts == 0, 0.0, np.where(counts == 1, d1, np.where(counts == 2, d2, d3)))


def prob(model: KneserNey, history: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """p(target | history) for each row; history [N, order-1] with -1 for missing (stream start) tokens."""
    V = model.vocab_size
    history = np.asarray(history, dtype=np.int64).reshape(len(targets), model.order - 1)
    targets = np.asarray(targets, dtype=np.int64)  # [N]
    p = np.full(len(targets), 1.0 / V)  # order 0: uniform
    for k, level in enumerate(model.levels, start=1):
        ctx_tokens = history[:, history.shape[1] - (k - 1) :]  # [N, k-1] the nearest k-1 tokens
        known = (ctx_tokens >= 0).all(axis=1)
        ctx = np.zeros(len(targets), dtype=np.int64)
        for j in range(k - 1):
            ctx = ctx * V + np.maximum(ctx_tokens[:, j], 0)
        c = _lookup(level.keys, level.counts, ctx * V + targets)
        total = _lookup(level.ctx_keys, level.ctx_total, ctx)
        backoff = _lookup(level.ctx_keys, level.ctx_backoff, ctx)
        seen = known & (total > 0)  # an unseen context passes the lower order through unchanged
        safe = np.where(seen, total, 1.0)
        p_k = (np.maximum(c - _discount_of(level, c), 0.0) + backoff * p) / safe
        p = np.where(seen, p_k, p)
    return p


def distribution(model: KneserNey, history) -> np.ndarray:
    """The full next-token distribution [V] after a history (its last order-1 tokens are used)."""
    V, n = model.vocab_size, model.order - 1
    h = [-1] * n + [int(t) for t in history]
    h = np.asarray(h[len(h) - n :] if n else [], dtype=np.int64)
    return prob(model, np.broadcast_to(h, (V, n)), np.arange(V))


def stream_log_probs(model: KneserNey, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """log p(tokens[i] | the up to order-1 tokens before i in the same stream) for each i in positions."""
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)  # [N]
    n = model.order - 1
    offsets = positions[:, None] - np.arange(n, 0, -1)[None, :]  # [N, n] oldest first
    history = np.where(offsets >= 0, tokens[np.maximum(offsets, 0)], -1)
    return np.log(prob(model, history, tokens[positions]))


def perplexity(model: KneserNey, tokens: np.ndarray, positions: np.ndarray) -> float:
    return float(np.exp(-np.mean(stream_log_probs(model, tokens, positions))))
