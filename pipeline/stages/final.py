"""At the end of training: a checkpoint of the last step, checkpoints/final, and run.json marked complete."""
from __future__ import annotations

import logging

from pipeline.stages.base import Stage

log = logging.getLogger("pipeline")


class Final(Stage):
    name = "final"

    def __init__(self, order: int = 90):
        super().__init__(order)

    def finish(self, ctx) -> None:
        directory = ctx.checkpoint(links=("final",))
        ctx.write_status("complete")
        log.info("final checkpoint: %s", directory)
