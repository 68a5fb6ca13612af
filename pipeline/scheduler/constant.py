"""A constant learning rate."""

from pipeline.scheduler.base import Scheduler


class Constant(Scheduler):
    def lr_at(self, k: int) -> float:
        return self.base_lr
