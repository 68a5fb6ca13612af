"""Data-parallel shards in one process: a fixed split and a fixed-order reduction, whatever the thread count."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
from numpy.random import Generator
from threadpoolctl import ThreadpoolController

from pipeline.data.base import Batch

R = TypeVar("R")
Grads = dict[str, np.ndarray]  # parameter name -> its gradient


def split(batch: Batch, shards: int) -> list[Batch]:
    """`shards` contiguous views along the sample axis, sized as np.array_split (empty ones when shards > B)."""
    parts = zip(*(np.array_split(a, shards) for a in (batch.ids, batch.x, batch.y)))
    return [Batch(ids=ids, x=x, y=y, extra=batch.extra) for ids, x, y in parts]


def owned(grads: Grads) -> Grads:
    """The same gradients as arrays of their own, safe to add into (no view, no array under two names)."""
    out, seen = {}, set()
    for name, g in grads.items():
        out[name] = g if g.flags.owndata and g.flags.writeable and id(g) not in seen else g.copy()
        seen.add(id(out[name]))
    return out


def child_rngs(rng: Generator | None, shards: int) -> list[Generator | None]:
    """One generator per shard, seeded by one draw before any runs: rng's state after depends on the count alone."""
    if rng is None:
        return [None] * shards
    seeds = rng.integers(0, 2**64, size=shards, dtype=np.uint64)  # [shards]
    return [Generator(np.random.PCG64(int(s))) for s in seeds]


class Shards(contextlib.AbstractContextManager):
    """A model's loss and gradients over `shards` pieces of a batch (semantic) on `threads` threads (not: summed in
    shard order), BLAS on one thread until close() (threaded GEMMs split sums; idle ones spin); models only read."""

    def __init__(self, shards: int, threads: int | None = None):
        if threads is None:  # the cores it may use (CPU affinity; off Linux, all)
            affinity = getattr(os, "sched_getaffinity", None)
            threads = len(affinity(0)) if affinity else os.cpu_count() or 1
        self.shards, self.threads, self._closed = int(shards), int(threads), False
        # The calling thread works too: threads - 1 helpers. None when there is nothing to share.
        self._pool = ThreadPoolExecutor(self.threads - 1, "shard") if self.threads > 1 else None
        self._blas = ThreadpoolController().select(user_api="blas").lib_controllers  # once (~1 ms)
        self._blas_before = [lib.get_num_threads() for lib in self._blas]
        self._pin_blas()

    def loss_and_grads(self, model, batch: Batch, rng: Generator | None) -> tuple[float, Grads]:
        """The batch's mean loss sum_k (B_k/B) l_k and gradients, (g_0 + ... + g_{n-1}) * (1/n) for equal pieces, else
        sum_k g_k * (B_k/B), in shard order over the non-empty pieces; shards == 1 is model.loss_and_grads itself."""
        self._pin_blas()
        if self.shards == 1:
            return model.loss_and_grads(batch, rng)
        pieces, rngs = split(batch, self.shards), child_rngs(rng, self.shards)
        run = [k for k, p in enumerate(pieces) if len(p.ids)]
        results = self._map(lambda k: model.loss_and_grads(pieces[k], rngs[k]), run)
        weights = [len(pieces[k].ids) / len(batch.ids) for k in run]  # floats: grads keep dtype
        loss = 0.0  # a loop, not sum(): 3.12's sum() of floats is compensated, other bits
        for w, (piece_loss, _) in zip(weights, results):
            loss += w * piece_loss
        equal = len(set(weights)) == 1  # equal pieces
        grads = owned(results[0][1])
        for name, acc in grads.items():
            if equal:
                for _, g in results[1:]:
                    acc += g[name]
                acc *= 1.0 / len(results)
            else:
                acc *= weights[0]
                for w, (_, g) in zip(weights[1:], results[1:]):
                    acc += g[name] * w
        return loss, grads

    def mean_loss(self, model, batches: Iterable[Batch]) -> float:
        """Mean of model.evaluate over non-empty batches by size, in batch order, `threads` at a time (any count)."""
        self._pin_blas()
        total, count = 0.0, 0
        nonempty = (b for b in batches if len(b.ids))
        while window := list(itertools.islice(nonempty, self.threads)):
            losses = self._map(lambda k: model.evaluate(window[k]), list(range(len(window))))
            for b, loss in zip(window, losses):
                total += loss * len(b.ids)
                count += len(b.ids)
        if count == 0:
            raise ValueError("mean_loss got no samples: the validation batches are empty")
        return total / count

    def _pin_blas(self) -> None:
        if self._closed:
            raise RuntimeError("this Shards is closed: make a new one")
        for lib in self._blas:
            if lib.get_num_threads() != 1:  # ~1 us; threadpoolctl's limit() costs ~35 us a call
                lib.set_num_threads(1)

    def _map(self, fn: Callable[[int], R], keys: list[int]) -> list[R]:
        """[fn(k) for k in keys], in key order, by this thread and up to threads - 1 helpers, each taking the next key;
        after a failure no key starts, and the first exception is re-raised once every thread has stopped."""
        if self._pool is None or len(keys) == 1:
            return [fn(k) for k in keys]
        results: list = [None] * len(keys)
        todo = iter(range(len(keys)))  # indices of keys, each taken once (next() is atomic)

        def work() -> None:
            for i in todo:
                try:
                    results[i] = fn(keys[i])
                except BaseException:
                    collections.deque(todo, maxlen=0)  # emptied: then nobody starts a key
                    raise

        helpers = [self._pool.submit(work) for _ in range(min(self.threads, len(keys)) - 1)]
        try:
            work()
        finally:
            errors = [f.exception() for f in helpers]  # waits for every helper
        if error := next((e for e in errors if e is not None), None):
            raise error
        return results

    def close(self) -> None:
        """Stop the pool and give BLAS its thread count back; idempotent."""
        if not self._closed:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            for lib, n in zip(self._blas, self._blas_before):
                lib.set_num_threads(n)

    def __exit__(self, *exc) -> None:
        self.close()
