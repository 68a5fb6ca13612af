"""A scheduler sets optimizer.lr from a pure function of (base_lr, number of updates taken)."""

from __future__ import annotations


class Scheduler:
    def __init__(self, optimizer):
        self.optimizer, self.base_lr = optimizer, optimizer.lr
        self.last_epoch = 0  # updates taken, as torch's LRScheduler counts after construction
        self.optimizer.lr = self.lr_at(0)

    def lr_at(self, k: int) -> float:
        """The learning rate used by update k (0-based)."""
        raise NotImplementedError

    def step(self) -> None:
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def state_dict(self) -> dict:
        # Only the counter: base_lr and the schedule's shape are config, so allowed changes to them apply.
        return {"last_epoch": self.last_epoch}

    def check_state_dict(self, state: dict) -> None:
        if state["last_epoch"] < 0:
            raise ValueError(f"last_epoch={state['last_epoch']} is negative")

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.optimizer.lr = self.lr_at(self.last_epoch)  # the next update's, as after step()
