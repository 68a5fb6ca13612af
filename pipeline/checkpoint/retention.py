"""Which checkpoints survive: pure policies over records (step, metrics, tags: a manifest's), composed with AnyOf."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Record:
    step: int
    metrics: dict = field(default_factory=dict, hash=False, compare=False)
    tags: frozenset = frozenset()
    lineage: str | None = None  # the id of the run history that wrote it


class Policy(Protocol):
    def keep(self, records: Sequence[Record]) -> set[int]:
        """The steps this policy preserves."""


def is_better(value, best, mode: str, min_delta: float = 0.0) -> bool:
    """Strict improvement by more than min_delta (Lightning's EarlyStopping rule); only a finite value improves."""
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def check_best(best, step, mode: str) -> None:
    """A saved (best, best_step) pair: both None, or a finite number and the step (>= 0) it was reached at."""
    bad_step = step is not None and (type(step) is not int or step < 0)
    if (best is None) != (step is None) or bad_step:
        raise ValueError(f"best {best!r} at step {step!r} is not a best value and its step")
    if best is not None and not is_better(best, None, mode):
        raise ValueError(f"best {best!r} is not a finite number")


@dataclass(frozen=True)
class LatestN:
    """The newest n records (among those tagged `tag`, if given)."""

    n: int
    tag: str | None = None

    def keep(self, records: Sequence[Record]) -> set[int]:
        steps = sorted(r.step for r in records if self.tag is None or self.tag in r.tags)
        return set(steps[-self.n :]) if self.n > 0 else set()


def rank(mode: str):
    """The order of evaluations, best first: by value, then the earlier step (Lightning's strict full top-k)."""
    sign = 1.0 if mode == "min" else -1.0
    return lambda value_step: (sign * value_step[0], value_step[1])


def admit(top: Sequence[tuple[float, int]], value, step: int, n: int, mode: str) -> list | None:
    """The n best (value, step), best first, once this one joins `top` (the n best so far), if among them; else None."""
    if not is_better(value, None, mode):
        return None
    if len(top) >= n and rank(mode)((float(value), step)) >= rank(mode)(top[n - 1]):
        return None
    return sorted([*top, (float(value), step)], key=rank(mode))[:n]


@dataclass(frozen=True)
class BestN:
    """The n records with the best finite `monitor` after step `since` (where this best history began)."""

    monitor: str
    mode: str = "min"
    n: int = 1
    since: int = 0

    def keep(self, records: Sequence[Record]) -> set[int]:
        values = [(r.metrics.get(self.monitor), r.step) for r in records if r.step > self.since]
        scored = [(v, s) for v, s in values if isinstance(v, (int, float)) and math.isfinite(v)]
        return {step for _, step in sorted(scored, key=rank(self.mode))[: self.n]}


@dataclass(frozen=True)
class AnyOf:
    """Keep what any of the policies keeps."""

    policies: tuple

    def keep(self, records: Sequence[Record]) -> set[int]:
        return set().union(*(p.keep(records) for p in self.policies))


@dataclass(frozen=True)
class Named:
    """Second names (links beside step-*) for the steps `policy` keeps, made by `name(record)` (None: no name)."""

    policy: Policy
    name: Callable[[Record], str | None]

    def links(self, records: Sequence[Record]) -> dict[str, int]:
        kept = self.policy.keep(records)
        return {k: r.step for r in records if r.step in kept and (k := self.name(r)) is not None}


def select_one(policy: Policy, records: Sequence[Record]) -> int | None:
    """The step a link following `policy` points at: the newest of what it keeps (None if nothing)."""
    return max(policy.keep(records), default=None)
