"""The train stage: runs the step loop, asking the other stages after every update whether to checkpoint."""
from __future__ import annotations

from pipeline.stages.base import Stage
from pipeline.trainer.loop import Trainer, end_of_epoch


class CheckpointHook:
    """Adapts the trainer's per-step callback to the stages' two-phase protocol: decide, save once, notify."""

    def __init__(self, ctx):
        self.ctx = ctx

    def on_step_end(self, state, record: dict) -> None:
        epoch_done = end_of_epoch(state)
        # Every stage decides (and updates its own state) before the one save they share.
        wants = [s.wants_checkpoint(self.ctx, record, epoch_done) for s in self.ctx.stages]
        if any(wants):
            self.ctx.checkpoint()


class Train(Stage):
    name = "train"

    def __init__(self, eval_every: int = 0, order: int = 10):
        super().__init__(order)
        self.eval_every = int(eval_every)

    def run(self, ctx, callbacks: list) -> None:
        if ctx.complete:
            return
        Trainer(self.eval_every, [*callbacks, CheckpointHook(ctx)]).fit(ctx.state)
