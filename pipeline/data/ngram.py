"""An interpolated modified Kneser-Ney n-gram language model over integer tokens, fitted with numpy."""

from __future__ import annotations

import math
from collections.abc import Iterator
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


def _sorted_keys(tokens: np.ndarray, k: int, V: int) -> np.ndarray:
    """The keys of every k-gram, sorted: [N-k+1] int64, one array built and sorted in place."""
    n = len(tokens) - k + 1
    key = tokens[:n].astype(np.int64)
    for j in range(1, k):
        key *= V
        key += tokens[j : j + n]
    key.sort()
    return key


def _run_starts(a: np.ndarray) -> np.ndarray:
    """Where each run of a sorted array starts [G]: np.unique's return_index in one pass (its hashing: 100x slower)."""
    first = np.empty(len(a), dtype=bool)  # [N]
    first[:1] = True
    np.not_equal(a[1:], a[:-1], out=first[1:])
    return np.flatnonzero(first)


def _counted(held: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values [G], their counts [G] float64) of the sorted array in `held`, emptied to free it once read."""
    n, starts = len(held[0]), _run_starts(held[0])
    values = held.pop()[starts]  # the list held its last reference: freed here
    counts = np.empty(len(starts), dtype=np.float64)
    np.subtract(starts[1:], starts[:-1], out=counts[:-1])
    counts[-1:] = n - starts[-1:]
    return values, counts


FALLBACK = (0.5, 1.0, 1.5)  # KenLM's --discount_fallback


def _discounts(counts: np.ndarray) -> tuple[float, float, float]:
    # Chen & Goodman's estimates from the count-of-counts, clipped so no count goes negative.
    n1, n2, n3, n4 = (float(np.count_nonzero(counts == c)) for c in (1, 2, 3, 4))
    if n1 == 0 or n2 == 0:
        return FALLBACK  # too little data for the estimate
    y = n1 / (n1 + 2 * n2)
    d1, d2 = 1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2
    d3 = 3 - 4 * y * n4 / n3 if n3 > 0 else 2.0
    return float(np.clip(d1, 0, 1)), float(np.clip(d2, 0, 2)), float(np.clip(d3, 0, 3))


def _discount(d: tuple[float, float, float], c: np.ndarray) -> np.ndarray:
    """Each count's discount: 0 (an unseen gram), D1, D2 or D3+."""
    return np.where(c == 0, 0.0, np.where(c == 1, d[0], np.where(c == 2, d[1], d[2])))


def _level(keys: np.ndarray, counts: np.ndarray, V: int) -> Level:
    ctx = keys // V  # keys are sorted, so contexts are runs
    start = _run_starts(ctx)
    ctx_keys = ctx[start]
    del ctx
    # Estimates clipped to 0 (tiny data) leave unseen tokens probability 0 (infinite perplexity); fallbacks are > 0.
    for d in (_discounts(counts), FALLBACK):
        ctx_backoff = np.add.reduceat(_discount(d, counts), start)
        if np.all(ctx_backoff > 0):
            break
    return Level(keys, counts, ctx_keys, np.add.reduceat(counts, start), ctx_backoff, d)


def _levels(tokens: np.ndarray, order: int, V: int) -> Iterator[Level]:
    """Orders 1..`order` (lower ones of continuation counts), each from the tokens alone: one held at a time."""
    top = max(1, int(63 // math.log2(max(V, 2))))  # a key packs k tokens in base V into an int64
    if not 1 <= order <= top:
        raise ValueError(f"n-gram order {order} must be in [1, {top}] for vocab size {V}")
    if len(tokens) < order:
        raise ValueError(f"{len(tokens)} tokens are too few to fit an order-{order} n-gram")
    for k in range(1, order + 1):
        if k == order:
            held = [_sorted_keys(tokens, k, V)]
        else:  # continuation counts: how many distinct tokens precede each k-gram
            held = [_counted([_sorted_keys(tokens, k + 1, V)])[0]]  # every distinct (k+1)-gram once
            np.remainder(held[0], V**k, out=held[0])  # its last k tokens
            held[0].sort()
        yield _level(*_counted(held), V)  # no reference kept: the caller's drop frees it


def _lookup(sorted_keys: np.ndarray, query: np.ndarray, *values: np.ndarray) -> list[np.ndarray]:
    i = np.minimum(np.searchsorted(sorted_keys, query), len(sorted_keys) - 1)  # one search for all
    return [np.where(sorted_keys[i] == query, v[i], 0.0) for v in values]


def _mixed(level: Level, V: int, k: int, toks: np.ndarray, at: np.ndarray, p) -> np.ndarray:
    """p(toks[i] | the k-1 tokens before i) [N] for i in `at` from order k's counts and `p` [N] to order k-1."""
    ctx = np.zeros(len(at), dtype=np.int64)
    for j in range(k - 1, 0, -1):
        ctx = ctx * V + toks[np.maximum(at - j, 0)]
    (c,) = _lookup(level.keys, ctx * V + toks[at], level.counts)
    total, backoff = _lookup(level.ctx_keys, ctx, level.ctx_total, level.ctx_backoff)
    # a history cut by the stream's start, or unseen, keeps the lower order's p
    seen = (at >= k - 1) & (total > 0)
    safe = np.where(seen, total, 1.0)
    p_k = (np.maximum(c - _discount(level.discounts, c), 0.0) + backoff * p) / safe
    return np.where(seen, p_k, p)


PIECE = 1 << 20  # positions scored at a time


def _raised(levels, V: int, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """p(tokens[i] | the tokens before i) [N] for i in positions, one level (order 1, 2, ...) and PIECE at a time."""
    positions = np.asarray(positions, dtype=np.int64)  # [N]
    p = np.full(len(positions), 1.0 / V)
    for k, level in enumerate(levels, start=1):
        for a in range(0, len(positions), PIECE):
            piece = p[a : a + PIECE]
            piece[:] = _mixed(level, V, k, tokens, positions[a : a + PIECE], piece)
        del level
    return p


def fitted_perplexity(train, order: int, V: int, tokens: np.ndarray, positions) -> float:
    """The order-`order` model of `train`'s perplexity on `tokens` at `positions`, one level at a time."""
    p = _raised(_levels(np.asarray(train), order, V), V, tokens, positions)
    return float(np.exp(-np.mean(np.log(p))))
