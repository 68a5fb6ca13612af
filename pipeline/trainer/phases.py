"""trainer.profile: wall time per phase, one table at the end; off, a shared no-op. Clocks only: no number changes."""

from __future__ import annotations

import contextlib
import time

# In the table's order; `end summary`: curves.png and the summary's lines; `other`: the wall time no phase covers
# (run.json, metrics.jsonl, progress lines, the stages' decisions): rows add up to the wall since start (after set-up).
PHASES: tuple[str, ...] = ("data", "forward/backward", "optimizer", "evaluation", "checkpoint")
PHASES += ("tracking hand-over", "end summary", "other")
_OFF = contextlib.nullcontext()


class Profile:
    def __init__(self, on: bool):
        self.on = bool(on)
        self.seconds, self.calls = dict.fromkeys(PHASES[:-1], 0.0), dict.fromkeys(PHASES[:-1], 0)
        self.start()

    def start(self) -> None:
        """The wall time counts from here."""
        self.started = time.perf_counter()

    def phase(self, name: str):
        """A context that adds its wall time to `name` (nested phases are not subtracted: keep them apart)."""
        return self._timed(name) if self.on else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1

    def table(self) -> str:
        """Calls and seconds of every phase, `other` last: the rows add up to the wall since start."""
        wall = time.perf_counter() - self.started
        rows = [(name, self.calls[name], self.seconds[name]) for name in PHASES[:-1]]
        rows += [("other", 0, max(0.0, wall - sum(s for _, _, s in rows))), ("wall", 0, wall)]
        lines = [f"{'phase':<20}{'calls':>8}{'seconds':>12}{'share':>8}"]
        lines += [f"{n:<20}{c or '':>8}{s:>12.4f}{s / (wall or 1e-12):>8.1%}" for n, c, s in rows]
        return "profile (trainer.profile=true):\n" + "\n".join(lines)


OFF = Profile(False)  # never records: the default of every timed function
