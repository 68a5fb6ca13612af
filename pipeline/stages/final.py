"""The end of training: a checkpoint of the last step, pointed at by checkpoints/final."""

from __future__ import annotations

from pipeline.checkpoint.retention import LatestN
from pipeline.stages.base import Stage, StepEnd


class Final(Stage):
    name = "final"
    link = "final"

    def wants_checkpoint(self, end: StepEnd) -> bool:
        return end.last

    def policy(self) -> LatestN:
        return LatestN(1, tag=self.name)

    link_policy = policy
