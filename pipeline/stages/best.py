"""Keeps a checkpoint of the best evaluation of `monitor` (min or max), pointed at by checkpoints/best."""
from __future__ import annotations

from pipeline.stages.base import Stage
from pipeline.stages.retention import is_better


class BestVal(Stage):
    name = "best_val"

    def __init__(self, monitor: str = "val/loss", mode: str = "min", order: int = 30):
        super().__init__(order)
        if mode not in ("min", "max"):
            raise ValueError(f"stages.best_val.mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode = monitor, mode
        self.best: float | None = None
        self.best_step: int | None = None
        self._improved = False

    def wants_checkpoint(self, ctx, record: dict, epoch_done: bool) -> bool:
        value = record.get(self.monitor)
        self._improved = value is not None and is_better(float(value), self.best, self.mode)
        if self._improved:
            self._previous = self.best_step
            self.best, self.best_step = float(value), record["step"]
        return self._improved

    def on_checkpoint(self, ctx, step: int, directory) -> None:
        if not (self._improved and step == self.best_step):
            return
        ctx.point("best", step)
        self._improved = False
        old = self._previous
        # The old best goes unless another rule still keeps it (periodic rotation, final, resume point).
        if old is not None and old != step and not ctx.is_periodic(old) and old not in ctx.protected_steps():
            ctx.delete(old)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "monitor": self.monitor, "mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
