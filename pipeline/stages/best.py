"""Keeps the checkpoint of the best evaluation of `monitor` (min or max), pointed at by checkpoints/best."""
from __future__ import annotations

from pipeline.checkpoint.retention import BestN, check_best, is_better
from pipeline.stages.base import Stage, StepEnd


class BestVal(Stage):
    name = "best_val"
    link = "best"

    def __init__(self, monitor: str, mode: str, order: int):
        super().__init__(order)
        if mode not in ("min", "max"):
            raise ValueError(f"stages.best_val.mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode = str(monitor), str(mode)
        self.best: float | None = None
        self.best_step: int | None = None

    def wants_checkpoint(self, end: StepEnd) -> bool:
        value = end.metrics.get(self.monitor)
        if not is_better(value, self.best, self.mode):  # NaN and infinities never become best
            return False
        self.best, self.best_step = float(value), end.step
        return True

    def policy(self) -> BestN:
        return BestN(self.monitor, self.mode, 1)

    def link_policy(self) -> BestN:
        return BestN(self.monitor, self.mode, 1)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step}

    def check_state_dict(self, state: dict) -> None:
        check_best(state["best"], state["best_step"], self.mode)

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step = state["best_step"]
