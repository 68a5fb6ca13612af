"""Pure retention rules over checkpoint records (step, metrics): no disk, tested with fake records."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    step: int
    metrics: dict


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Strict improvement; NaN never improves, anything finite beats no best yet."""
    if value is None or math.isnan(value):
        return False
    if best is None:
        return True
    return value < best if mode == "min" else value > best


def best_step(records: list[Record], monitor: str, mode: str) -> int | None:
    """The first step holding the best value of `monitor` (ties keep the earlier one)."""
    best, step = None, None
    for r in records:
        v = r.metrics.get(monitor)
        if v is not None and is_better(v, best, mode):
            best, step = v, r.step
    return step


def latest(steps: list[int], keep: int) -> set[int]:
    return set(sorted(steps)[-keep:]) if keep > 0 else set()


def to_delete(periodic: list[int], keep: int, protected: set[int]) -> list[int]:
    """Periodic checkpoints past the newest `keep`, never a protected one, never the newest of all."""
    if not periodic:
        return []
    kept = latest(periodic, keep) | set(protected) | {max(periodic)}
    return sorted(s for s in periodic if s not in kept)
