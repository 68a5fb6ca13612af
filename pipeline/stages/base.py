"""A stage: hooks the run calls in a fixed order, a retention policy, and state that rides in checkpoints."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.checkpoint.retention import Policy, check_best


@dataclass(frozen=True)
class StepEnd:
    """What the run knows at the end of an update, for every stage's decision."""

    step: int
    metrics: dict  # measured at this step: train/loss, lr, grad_norm, and val/* when it evaluated
    epoch_done: bool  # this update consumed the last full batch of its epoch
    epochs_done: int  # epochs completed, counting this one if epoch_done
    last: bool  # the run's final update (the step budget is spent, or a stage stopped the run)


class Stage:
    """Every hook is optional; `order` sorts stages (lower first); `name` is its key under `stages`."""

    name = "stage"
    link: str | None = None  # a checkpoints/<link> symlink that follows link_policy() (best, final)

    def __init__(self, order: int):
        self.order = int(order)

    def setup(self, run) -> None:
        """Before training: may restore a checkpoint or find the run complete."""

    def stop_reason(self, end: StepEnd) -> str | None:
        """After each update, before any checkpoint decision: a reason to end the run here, or None."""
        return None

    def wants_checkpoint(self, end: StepEnd) -> bool:
        """After each update: update own state, and ask for a checkpoint of this step."""
        return False

    def policy(self) -> Policy | None:
        """Which checkpoints this stage keeps (records tagged with its name are the ones it asked for)."""
        return None

    def link_policy(self) -> Policy | None:
        """The one checkpoint `link` points at."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Watch(Stage):
    """A stage following the best finite value of the metric `monitor` (mode min or max); it rides in checkpoints."""

    def __init__(self, monitor: str, mode: str, order: int):
        super().__init__(order)
        if mode not in ("min", "max"):
            raise ValueError(f"stages.{self.name}.mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode = str(monitor), str(mode)
        self.best: float | None = None
        self.best_step: int | None = None

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step}

    def check_state_dict(self, state: dict) -> None:
        check_best(state["best"], state["best_step"], self.mode)

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step = state["best_step"]


class StageStates:
    """The `stages` part of the state: every stage's own state by name. A stage added or removed by
    override since the checkpoint (stages are not part of the run's identity) starts fresh or is dropped."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.free_form_state = ("",)

    def state_dict(self) -> dict:
        return {s.name: s.state_dict() for s in self.stages}

    def check_state_dict(self, state: dict) -> None:
        from pipeline.stateful import fit_reason

        for s in self.stages:
            if s.name in state:
                if reason := fit_reason(s.state_dict(), state[s.name], s.name):
                    raise ValueError(reason)
                own = getattr(s, "check_state_dict", None)
                if own is not None:
                    own(state[s.name])

    def load_state_dict(self, state: dict) -> None:
        for s in self.stages:
            if s.name in state:
                s.load_state_dict(state[s.name])
