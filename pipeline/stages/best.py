"""The checkpoints of the `keep` best evaluations of `monitor` (Lightning's save_top_k); checkpoints/best."""

from __future__ import annotations

import math

from pipeline.checkpoint.retention import BestN, Named, admit, rank
from pipeline.files import patterns
from pipeline.stages.base import StepEnd, Watch


class BestVal(Watch):
    name = "best_val"
    link = "best"
    later = (*Watch.later, "top")

    def __init__(self, monitor: str, mode: str, order: int, keep: int, filename: str | None):
        super().__init__(monitor, mode, order)  # keep >= 1, filename a pattern: config/schemas.py
        self.keep = int(keep)
        self.filename = filename  # a pattern naming each kept checkpoint by its values (`{step}-{val/loss:.3f}`)
        self.top: list[tuple[float, int]] = []  # the `keep` best (value, step), best first

    def wants_checkpoint(self, end: StepEnd) -> bool:
        # NaN and infinities never enter, nor a value no better than the keep-th best
        top = admit(self.top, end.metrics.get(self.monitor), end.step, self.keep, self.mode)
        if top is not None:
            self.top = top
            self.best, self.best_step = top[0]
        return top is not None

    def policy(self) -> BestN:
        return BestN(self.monitor, self.mode, self.keep, self.since)

    def link_policy(self) -> BestN:
        return BestN(self.monitor, self.mode, 1, self.since)

    def named(self) -> Named | None:
        if (pattern := self.filename) is None:
            return None
        return Named(self.policy(), lambda r: patterns.render(pattern, r.step, r.metrics))

    # state: Watch's (best, best_step, ...), and with keep > 1 the top list (keep = 1: the same bytes as before)
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.keep > 1:
            state["top"] = [[value, step] for value, step in self.top]
        return state

    def start_at(self, step: int) -> None:
        super().start_at(step)
        self.top = []

    def fit_reason(self, saved: dict) -> str | None:
        # `top` is as long as the evaluations counted so far, and absent where the checkpoint kept one best
        if not isinstance(saved.get("top", []), list):
            return f"{self.name}.top: expected a list of [value, step], got {type(saved['top']).__name__}"
        return super().fit_reason({k: v for k, v in saved.items() if k != "top"})

    def check_state_dict(self, state: dict) -> None:
        super().check_state_dict(state)
        if "top" not in state:
            return
        top = state["top"]

        def entry(e) -> bool:
            if not (isinstance(e, list) and len(e) == 2 and type(e[1]) is int and e[1] >= 0):
                return False
            return isinstance(e[0], (int, float)) and type(e[0]) is not bool and math.isfinite(e[0])

        if not all(entry(e) for e in top):
            raise ValueError(f"top {top!r:.80} is not a list of [finite value, step]")
        pairs = [(float(v), s) for v, s in top]
        if pairs != sorted(pairs, key=rank(self.mode)) or len({s for _, s in pairs}) != len(pairs):
            raise ValueError(f"top {top!r:.80} is not ranked best first, one entry a step")
        if (pairs[0] if pairs else (None, None)) != (state["best"], state["best_step"]):
            best = f"the best {state['best']!r} at step {state['best_step']!r}"
            raise ValueError(f"top {top!r:.80} does not begin with {best}")

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # A checkpoint that kept one best (keep was 1) knows that one: the top list grows from it.
        saved = [(float(v), int(s)) for v, s in state.get("top", [])]
        if "top" not in state and self.best is not None and self.best_step is not None:
            saved = [(self.best, self.best_step)]
        self.top = saved[: self.keep]
