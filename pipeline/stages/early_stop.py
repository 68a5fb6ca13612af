"""Ends the run once `monitor` has not improved by more than `min_delta` for `patience` evaluations in a row."""

from __future__ import annotations

from pipeline.checkpoint.retention import is_better
from pipeline.stages.base import StepEnd, Watch


class EarlyStop(Watch):
    """An evaluation without improvement adds to `wait`, one with resets it; `wait` at `patience` ends the run."""

    name = "early_stop"
    keys = (*Watch.keys, "wait")

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float, order: int):
        super().__init__(monitor, mode, order)  # patience >= 1, min_delta >= 0: config/schemas.py
        self.patience, self.min_delta = int(patience), float(min_delta)
        self.wait = 0  # evaluations since the last improvement

    def stop_reason(self, end: StepEnd) -> str | None:
        if self.monitor not in end.metrics:
            return None  # no evaluation at this step
        value = end.metrics[self.monitor]
        if is_better(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.wait = float(value), end.step, 0
            return None
        self.wait += 1
        if self.wait < self.patience:
            return None
        best = "no finite value yet"
        if self.best is not None:
            best = f"best {self.best:.6g} at step {self.best_step}"
        how = f"mode {self.mode}, min_delta {self.min_delta:g}; {best}"
        return f"early_stop: {self.monitor} did not improve in {self.wait} evaluations ({how})"

    def check_state_dict(self, state: dict) -> None:
        super().check_state_dict(state)
        wait = state["wait"]
        if type(wait) is not int or wait < 0:
            raise ValueError(f"wait {wait!r} is not a count of evaluations")

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.wait = int(state["wait"])
