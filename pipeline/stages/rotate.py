"""Periodic checkpoints at the configured cadence, keeping the newest N (default 3)."""
from __future__ import annotations

from pipeline.stages.base import Stage
from pipeline.stages.cadence import Cadence
from pipeline.stages.retention import to_delete


class RotateLastN(Stage):
    name = "rotate"

    def __init__(self, keep: int = 3, cadence: Cadence | None = None, order: int = 20):
        super().__init__(order)
        if keep < 1:
            raise ValueError(f"stages.rotate_last_3.keep must be >= 1, got {keep}")
        self.keep, self.cadence = int(keep), cadence or Cadence()
        self.periodic: list[int] = []  # steps of the periodic checkpoints still on disk

    def wants_checkpoint(self, ctx, record: dict, epoch_done: bool) -> bool:
        due = self.cadence.due(record["step"], epoch_done, ctx.state.iterator.epoch + 1)
        if due and record["step"] not in self.periodic:
            self.periodic.append(record["step"])  # before the save, so the checkpoint's own state lists it
        return due

    def on_checkpoint(self, ctx, step: int, directory) -> None:
        # Pruning is idempotent, so it runs after every verified save (a re-run finishes a killed one's work).
        others = {s for st in ctx.stages if st is not self for s in getattr(st, "periodic", ())}
        for old in to_delete(self.periodic, self.keep, ctx.protected_steps() | others):
            ctx.delete(old)
            self.periodic.remove(old)

    def state_dict(self) -> dict:
        return {"periodic": list(self.periodic)}

    def load_state_dict(self, state: dict) -> None:
        self.periodic = [int(s) for s in state["periodic"]]
