"""Periodic checkpoints at the configured cadence, keeping the newest N."""

from __future__ import annotations

from pipeline.checkpoint.retention import LatestN
from pipeline.stages.base import Stage, StepEnd
from pipeline.stages.cadence import Cadence


class RotateLastN(Stage):
    name = "rotate"

    def __init__(self, keep: int, cadence: Cadence, order: int):
        super().__init__(order)  # keep >= 1: config/schemas.py
        self.keep, self.cadence = int(keep), cadence

    def wants_checkpoint(self, end: StepEnd) -> bool:
        return self.cadence.due(end.step, end.epoch_done, end.epochs_done)

    def policy(self) -> LatestN:
        return LatestN(self.keep, tag=self.name)
