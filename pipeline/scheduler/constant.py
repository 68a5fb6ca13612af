"""A constant learning rate: the base scheduler's lr_at, the base lr for every update."""

from pipeline.scheduler.base import Scheduler


class Constant(Scheduler): ...
