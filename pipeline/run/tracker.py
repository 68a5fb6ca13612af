"""The tracker protocols the run and the sweep call, doing nothing (tracking=none; pipeline/tracking/ does)."""

from __future__ import annotations

from pathlib import Path


class SweepParent:
    """A sweep's parent run, as the launcher drives it (none here); built from the `tracking` node's values."""

    def __init__(self, **_):
        pass

    def facts(self, timeout: float) -> dict:
        """What sweep.json records for the jobs and the end (e.g. the store's uri, or why tracking is off)."""
        return {}

    def warm(self, sweep: dict) -> None:
        """The sweep's jobs run in this process: get tracking ready meanwhile, without asking for the parent."""

    def start(self, sweep: dict) -> bool:
        """Ask for the parent run, never waiting (jobs name it by the sweep's id); True if an index was asked."""
        return False

    def end(self, sweep: dict) -> list[str]:
        """Hand over the parent's end (waiting a bounded moment); the lines saying where it is, for the end table."""
        return ["not tracked (tracking=none)"]


class Tracker:
    """Every call returns quickly: the training loop never waits for tracking."""

    sweep_parent: type[SweepParent] = SweepParent  # built for the parent run of a sweep
    experiment_id: str | None = None  # the run's experiment, once known: the end block's UI page

    def __init__(self, **_):
        pass

    def prepare(self) -> None:
        """As soon as the job knows its config: start whatever tracking needs, off the job's path."""

    def start(
        self,
        *,
        config: dict,
        facts: dict,
        run_dir: Path,
        previous_run_uri: str | None,
        status: dict | None = None,
        start_time: float | None = None,
    ) -> None:
        """Begin (or continue the resumed checkpoint's `previous_run_uri`) the tracked run."""

    def attach(self, run_dir: Path) -> str | None:
        """A sweep job whose run was already complete: make the index show it in the sweep."""

    def run_uri(self, timeout: float) -> str | None:
        """The tracked run's URI for manifests, waiting at most `timeout` seconds for it to be known."""

    def log_line(self, line: dict) -> None:
        """One metrics.jsonl line (step, epoch, time, metrics)."""

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        """A checkpoint was written."""

    def finish(self, status: str, run_dir: Path) -> None:
        """Hand the run over (waiting a bounded moment at most); status is FINISHED, FAILED or KILLED."""
