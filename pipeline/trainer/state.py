"""The live objects one training run steps: the state machines, the data, and the run's progress counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.data.base import Dataset
from pipeline.data.iterator import DataIterator
from pipeline.files import jsonio
from pipeline.model.base import Model
from pipeline.optimizer.base import Optimizer
from pipeline.scheduler.base import Scheduler
from pipeline.stateful import PARTS
from pipeline.trainer.parallel import Shards
from pipeline.trainer.rng import Streams


@dataclass
class Progress:
    """Updates completed and clipped, the latest value of every metric (run.json's and the report's)."""

    step: int = 0
    metrics: dict = field(default_factory=dict)
    ended: str | None = None  # why the run ended ("max_steps", a stage's reason); None: it goes on
    clipped: int = 0  # updates whose gradient trainer.grad_clip scaled down
    free_form_state = ("metrics",)

    def state_dict(self) -> dict:
        return asdict(self)  # step, metrics (a copy), ended, clipped

    def check_state_dict(self, state: dict) -> None:
        for key in ("step", "clipped"):
            if type(state[key]) is not int or state[key] < 0:
                raise ValueError(f"{key} {state[key]!r} is not a count of updates")
        for v in state["metrics"].values():
            jsonio.number(v)
        if state["ended"] is not None and not isinstance(state["ended"], str):
            raise ValueError(f"ended {state['ended']!r} is not a reason")

    def load_state_dict(self, state: dict) -> None:
        self.step, self.clipped = int(state["step"]), int(state["clipped"])
        self.ended = state["ended"]
        self.metrics = {k: jsonio.number(v) for k, v in state["metrics"].items()}


@dataclass
class TrainState:
    model: Model
    optimizer: Optimizer
    scheduler: Scheduler
    iterator: DataIterator
    streams: Streams
    dataset: Dataset
    dtype: np.dtype
    total_steps: int
    # trainer.* (their values live in conf/trainer/default.yaml: no default here to disagree with it)
    accumulate: int  # micro-batches per update
    grad_clip: float  # the largest global L2 norm of an update's gradient; 0: no clipping
    shards: int  # pieces each micro-batch is split into (semantic: the dropout draws, the summation order)
    threads: int | None  # threads running the pieces (not semantic); None: the cores available
    eval_batches: int | None  # an evaluation reads the first N validation batches (None: all)
    eval_at_start: bool  # an evaluation before the first update
    stages: object  # the stages' states (pipeline.stages.base.StageStates), built by the run layer
    progress: Progress = field(default_factory=Progress)
    runner: Shards = field(init=False, repr=False)

    step = property(lambda self: self.progress.step)
    epoch = property(lambda self: self.iterator.epoch)
    metrics = property(lambda self: self.progress.metrics)

    def __post_init__(self):
        # from here to runner.close() BLAS runs on one thread (its pin): every number the same whatever the threads
        self.runner = Shards(self.shards, self.threads)

    def parts(self) -> dict:
        """Every state machine of pipeline.stateful.PARTS under its checkpoint name."""
        held_as = {"data_iter": "iterator", "rng": "streams"}  # the parts not held under that name
        return {name: getattr(self, held_as.get(name, name)) for name in PARTS}
