"""SIGTERM, SIGINT or SIGUSR1: finish the current step, checkpoint, exit with EXIT_PREEMPTED."""
from __future__ import annotations

import logging
import signal

from pipeline.trainer.loop import StopTraining

log = logging.getLogger("pipeline")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again; the identical command resumes
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preemption:
    """A trainer callback; installed signal handlers only set a flag, so no write is ever torn by them."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            log.warning("received %s: finishing this step, then checkpointing", signal.Signals(signum).name)
        self.received = signum  # a second signal changes nothing: the save in progress completes

    def install(self) -> None:
        for s in SIGNALS:
            self.previous[s] = signal.signal(s, self._handler)

    def uninstall(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def on_step_end(self, state, record: dict) -> None:
        if self.received is not None:
            raise StopTraining(signal.Signals(self.received).name)
