"""The train stage: the step loop, evaluating every `eval_every` updates (0: at the end of every epoch)."""

from __future__ import annotations

from pipeline.stages.base import Stage


class Train(Stage):
    name = "train"

    def __init__(self, eval_every: int, order: int):
        super().__init__(order)
        self.eval_every = int(eval_every)

    def run(self, run) -> None:
        run.train(self.eval_every)
