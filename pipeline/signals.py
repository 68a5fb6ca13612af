"""SIGTERM, SIGINT and SIGUSR1, from the first instruction of a job to its last: never a traceback.

Until a run holds its directory, nothing durable is being written (the corpus is published by rename), so a
signal stops the process at once: `Interrupted` unwinds to the entry point, which prints one line. Once the
run holds its directory, `defer()` turns signals into a flag: the current update finishes, a checkpoint is
written, and the process exits EXIT_PREEMPTED; a second signal changes nothing (the save in progress
completes). Either way the identical command continues the run: EX_TEMPFAIL, try again.
"""
from __future__ import annotations

import logging
import signal

log = logging.getLogger("pipeline")
EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Interrupted(BaseException):
    """A signal before the run held its directory (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class Signals:
    def __init__(self):
        self.received: int | None = None
        self.deferred = False
        self.installed = False

    def install(self) -> None:
        for s in SIGNALS:
            signal.signal(s, self._handler)
        self.installed = True

    def _handler(self, signum, frame) -> None:
        first = self.received is None
        self.received = signum if first else self.received
        if not self.deferred:
            raise Interrupted(signum)
        if first:
            log.warning("received %s: finishing this update, then checkpointing", signal.Signals(signum).name)

    def defer(self) -> None:
        """From now on a signal only sets the flag (raises at once if one already arrived)."""
        self.deferred = True
        if self.received is not None:
            raise Interrupted(self.received)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None


SIGNALS_STATE = Signals()  # one per process: the entry point installs it before importing anything heavy
