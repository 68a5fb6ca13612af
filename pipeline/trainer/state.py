"""The live objects of one run: the five state machines plus progress, assembled once."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.data.iterator import DataIterator
from pipeline.rng import Streams


@dataclass
class RunState:
    model: object
    optimizer: object
    scheduler: object
    iterator: DataIterator
    streams: Streams
    dataset: object
    dtype: np.dtype
    total_steps: int
    step: int = 0  # optimizer updates completed
    metrics: dict = field(default_factory=dict)  # latest value of every metric

    @property
    def epoch(self) -> int:
        return self.iterator.epoch

    def progress_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "total_steps": self.total_steps, "metrics": dict(self.metrics)}

    def load_progress(self, d: dict) -> None:
        self.step, self.metrics = int(d["step"]), dict(d["metrics"])
