"""The tracker protocol the run calls; every method does nothing here (pipeline/tracking/ implements it)."""
from __future__ import annotations

from pathlib import Path


class Tracker:
    """Every call returns quickly: the training loop never waits for tracking."""

    def prepare(self) -> None:
        """As soon as the job knows its config: start whatever tracking needs, off the job's path."""

    def start(self, *, config: dict, facts: dict, run_dir: Path, previous_run_uri: str | None,
              status: dict | None = None, start_time: float | None = None) -> None:
        """Begin (or continue the resumed checkpoint's `previous_run_uri`) the tracked run."""

    def attach(self, run_dir: Path) -> str | None:
        """A sweep job whose run was already complete: make the index show it in the sweep."""
        return None

    def run_uri(self, timeout: float) -> str | None:
        """The tracked run's URI for manifests, waiting at most `timeout` seconds for it to be known."""
        return None

    def log_line(self, line: dict) -> None:
        """One metrics.jsonl line (step, epoch, time, metrics)."""

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        """A checkpoint was written."""

    def finish(self, status: str, run_dir: Path) -> None:
        """Hand the run over (waiting a bounded moment at most); status is FINISHED, FAILED or KILLED."""

