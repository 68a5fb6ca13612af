"""When a periodic checkpoint is due: every N epochs and/or every N steps (the `checkpoint` group)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    every_epochs: int  # at the end of every Nth epoch; 0 = never by epoch
    every_steps: int  # every Nth update; 0 = never by step

    def due(self, step: int, epoch_done: bool, epochs_done: int) -> bool:
        by_epoch = self.every_epochs > 0 and epoch_done and epochs_done % self.every_epochs == 0
        by_step = self.every_steps > 0 and step % self.every_steps == 0
        return by_epoch or by_step
