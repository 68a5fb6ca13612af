"""The live objects one training run steps: the state machines, the data, and the run's progress counters."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline import jsonio
from pipeline.data.iterator import DataIterator
from pipeline.rng import Streams


@dataclass
class Progress:
    """Updates completed and the latest value of every metric (what run.json and the final report show)."""

    step: int = 0
    metrics: dict = field(default_factory=dict)
    ended: str | None = None  # why the run ended ("max_steps", or a stage's reason); None while it goes on
    free_form_state = ("metrics",)

    def state_dict(self) -> dict:
        return {"step": self.step, "metrics": dict(self.metrics), "ended": self.ended}

    def check_state_dict(self, state: dict) -> None:
        if type(state["step"]) is not int or state["step"] < 0:
            raise ValueError(f"step {state['step']!r} is not a count of updates")
        for v in state["metrics"].values():
            jsonio.number(v)
        if state["ended"] is not None and not isinstance(state["ended"], str):
            raise ValueError(f"ended {state['ended']!r} is not a reason")

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.metrics = {k: jsonio.number(v) for k, v in state["metrics"].items()}
        self.ended = state["ended"]


@dataclass
class TrainState:
    model: object
    optimizer: object
    scheduler: object
    iterator: DataIterator
    streams: Streams
    dataset: object
    dtype: np.dtype
    total_steps: int
    progress: Progress = field(default_factory=Progress)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def epoch(self) -> int:
        return self.iterator.epoch

    @property
    def metrics(self) -> dict:
        return self.progress.metrics

    def parts(self) -> dict:
        """The state machines under their checkpoint names (the job adds "stages")."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "data_iter": self.iterator, "rng": self.streams, "progress": self.progress}
