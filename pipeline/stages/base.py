"""A stage: a policy fed each step end (stop?, checkpoint?) with its own state (docs/stages.md: Writing a stage)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.checkpoint.retention import Named, Policy, check_best
from pipeline.stateful import BadValue, misfit


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
    # state keys added since its first release: a state saved before lacks them
    later: tuple[str, ...] = ()

    def __init__(self, order: int):
        self.order = int(order)

    def stop_reason(self, end: StepEnd) -> str | None:
        """After each update, before any checkpoint decision: a reason to end the run here, or None."""

    def wants_checkpoint(self, end: StepEnd) -> bool:
        """After each update: update own state, and ask for a checkpoint of this step."""
        return False

    def policy(self) -> Policy | None:
        """Which checkpoints this stage keeps (records tagged with its name are the ones it asked for)."""

    def link_policy(self) -> Policy | None:
        """The one checkpoint `link` points at."""

    def named(self) -> Named | None:
        """Second names (links beside step-*) for the checkpoints this stage keeps."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def continues(self, saved: dict) -> str | None:
        """Why a saved state of this stage no longer means the same with the live parameters (None: it does)."""

    def start_at(self, step: int) -> None:
        """This stage starts fresh at a resume to `step` (its state was not saved, or means another thing now)."""

    def fit_reason(self, saved: dict) -> str | None:
        """Why `saved` cannot replace this stage's state (keys, JSON kinds), or None."""
        live = {k: v for k, v in self.state_dict().items() if k in saved or k not in self.later}
        found = misfit(live, saved, (self.name,))
        return found[1] if found else None


class Watch(Stage):
    """A stage following the best finite value of `monitor` (min or max); another monitor or mode starts anew."""

    later: tuple[str, ...] = ("monitor", "mode", "since")
    keys: tuple[str, ...] = ("best", "best_step", *later)  # its state: these attributes

    def __init__(self, monitor: str, mode: str, order: int):
        super().__init__(order)  # mode is min or max: config/schemas.py
        self.monitor, self.mode = str(monitor), str(mode)
        self.best: float | None = None
        self.best_step: int | None = None
        self.since = 0  # the step its best history began at (a resume changed monitor or mode)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.keys}

    def start_at(self, step: int) -> None:
        self.since = int(step)

    def continues(self, saved: dict) -> str | None:
        # a state saved before monitor and mode rode along was measured by the live ones
        old = (saved.get("monitor", self.monitor), saved.get("mode", self.mode))
        if old != (self.monitor, self.mode):
            new = f"{self.monitor!r} mode {self.mode!r}"
            return f"monitor {old[0]!r:.80} mode {old[1]!r:.10} -> {new}"
        return None

    def check_state_dict(self, state: dict) -> None:
        check_best(state["best"], state["best_step"], self.mode)
        since = state.get("since", 0)
        if type(since) is not int or since < 0:
            raise ValueError(f"since {since!r:.40} is not a step")

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step = state["best_step"]
        self.since = state.get("since", 0)


class StageStates:
    """The `stages` part: each stage's state by name (docs/stages.md: Changing stages); `notes`, `fresh` of a load."""

    free_form_state = ("",)  # the names vary with the config: each stage checks its own entry
    # resume and train were stages until they became settings: their saved (empty) states are dropped unsaid
    former = ("resume", "train")

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.notes: list[str] = []
        self.fresh: set[str] = set()

    def state_dict(self) -> dict:
        return {s.name: s.state_dict() for s in self.stages}

    def _restored(self, state: dict) -> list[Stage]:
        saved = {k: v for k, v in state.items() if isinstance(v, dict)}
        return [s for s in self.stages if s.name in saved and not s.continues(saved[s.name])]

    def check_state_dict(self, state: dict) -> None:
        for name, saved in state.items():
            if not isinstance(saved, dict):
                raise BadValue(name, f"{name}: expected an object, got {type(saved).__name__}")
        for s in self._restored(state):
            if reason := s.fit_reason(state[s.name]):
                raise BadValue(s.name, reason)
            if (own := getattr(s, "check_state_dict", None)) is not None:
                own(state[s.name])

    def load_state_dict(self, state: dict) -> None:
        restored = self._restored(state)
        for s in restored:
            s.load_state_dict(state[s.name])
        live = {s.name for s in self.stages}
        self.fresh = live - {s.name for s in restored}
        self.notes = []
        for s in (s for s in self.stages if s.name in self.fresh):
            why = "not in the checkpoint, starts fresh here"
            if s.name in state:
                why = f"{s.continues(state[s.name])}: a new history from here"
            self.notes.append(f"{s.name}: {why}")
        gone, dropped = sorted(set(state) - live - set(self.former)), "no such stage in this config"
        self.notes += [f"{n}: {dropped}, its saved state is dropped" for n in gone]
