"""trainer.max_time: this process's wall-time budget (docs/stages.md: A time budget)."""

from __future__ import annotations

import os
import time

monotonic = time.monotonic  # the clock every measurement here reads (tests substitute their own)
_IMPORTED = monotonic()


def process_age() -> float:
    """Seconds since this process started: from /proc on Linux, else since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat(5)'s field 22: ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return monotonic() - _IMPORTED


class Budget:
    """A deadline on the monotonic clock, and the longest step and save seen so far in this process."""

    def __init__(self, seconds: float | None, age: float | None = None):
        self.deadline: float | None = None
        if seconds is not None:
            self.deadline = monotonic() - (process_age() if age is None else age) + seconds
        self.last_end: float | None = None
        self.slowest_step = 0.0  # step end to step end: update, evaluation, logging, any save
        self.slowest_save = 0.0

    def step_ended(self) -> bool:
        """Record a step end; True if another update and checkpoint, each as slow as the slowest, would overrun."""
        if self.deadline is None:
            return False
        now = monotonic()
        if self.last_end is not None:
            self.slowest_step = max(self.slowest_step, now - self.last_end)
        self.last_end = now
        return now + self.slowest_step + self.slowest_save >= self.deadline

    def saved(self, seconds: float) -> None:
        self.slowest_save = max(self.slowest_save, seconds)

    def start(self) -> None:
        """Training begins: the first step's duration counts from here."""
        self.last_end = monotonic()
