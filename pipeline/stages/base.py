"""A stage: hooks the run calls in a fixed order, and state that rides along in every checkpoint."""
from __future__ import annotations


class Stage:
    """Every hook is optional; `order` sorts stages (lower first)."""

    name = "stage"

    def __init__(self, order: int = 50):
        self.order = int(order)

    def setup(self, ctx) -> None:
        """Before training: may load a checkpoint or declare the run complete."""

    def wants_checkpoint(self, ctx, record: dict, epoch_done: bool) -> bool:
        """After each update: update own state, and ask for a checkpoint of this step."""
        return False

    def on_checkpoint(self, ctx, step: int, directory) -> None:
        """After a checkpoint of this step was written and verified."""

    def finish(self, ctx) -> None:
        """After training ended normally."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
