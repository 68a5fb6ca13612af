"""A scheduler sets optimizer.lr from a pure function of (base_lr, number of updates taken)."""
from __future__ import annotations


class Scheduler:
    def __init__(self, optimizer, run_total_steps: int | None = None):
        self.optimizer = optimizer
        self.run_total_steps = run_total_steps  # the run's number of updates, for schedules that need it
        self.base_lr = optimizer.lr
        self.last_epoch = 0  # updates taken so far, as torch's LRScheduler counts after construction
        self.optimizer.lr = self.lr_at(0)

    def lr_at(self, k: int) -> float:
        """The learning rate used by update k (0-based)."""
        raise NotImplementedError

    def step(self) -> None:
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        # Restores the counter only: the optimizer's own restored lr is left untouched (seed 003's order).
        self.last_epoch, self.base_lr = int(state["last_epoch"]), float(state["base_lr"])
