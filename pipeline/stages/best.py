"""Keeps the checkpoint of the best evaluation of `monitor` (min or max), pointed at by checkpoints/best."""
from __future__ import annotations

from pipeline.checkpoint.retention import BestN, is_better
from pipeline.stages.base import StepEnd, Watch


class BestVal(Watch):
    name = "best_val"
    link = "best"

    def wants_checkpoint(self, end: StepEnd) -> bool:
        value = end.metrics.get(self.monitor)
        if not is_better(value, self.best, self.mode):  # NaN and infinities never become best
            return False
        self.best, self.best_step = float(value), end.step
        return True

    def policy(self) -> BestN:
        return BestN(self.monitor, self.mode, 1, self.since)

    link_policy = policy
