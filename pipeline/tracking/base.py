"""The tracker protocol the run calls; the null tracker (tracking=none) does nothing."""
from __future__ import annotations

from pathlib import Path


class Tracker:
    """Every call must return quickly: the training loop never waits for tracking."""

    def start(self, *, config: dict, facts: dict, run_dir: Path, previous_run_uri: str | None,
              resumed_at: int | None = None) -> None:
        """Begin (or continue, given the run URI a resumed checkpoint recorded and its step) the tracked run."""

    def run_uri(self, timeout: float) -> str | None:
        """The tracked run's URI for manifests, waiting at most `timeout` seconds for it to be known."""
        return None

    def log_line(self, line: dict) -> None:
        """One metrics.jsonl line (step, epoch, time, metrics)."""

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        """A checkpoint was written and verified."""

    def finish(self, status: str, run_dir: Path) -> None:
        """Flush everything; status is FINISHED, FAILED or KILLED (preempted)."""


class NullTracker(Tracker):
    def __init__(self, **_):
        pass
