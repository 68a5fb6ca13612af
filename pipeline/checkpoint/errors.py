"""The one error a reader of a checkpoint or of a run's files sees: directory, file and reason in one line."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.errors import CommandError


class CheckpointError(CommandError):
    """`file` names the file at fault ("" when it is the directory itself, or a link to it)."""

    kind = "checkpoint"

    def __init__(self, directory: Path | str, file: str, reason: str):
        self.directory, self.file, self.reason = Path(directory), file, reason
        super().__init__(f"{self.kind} {self.directory}: {file + ': ' if file else ''}{reason}")


class MisfitError(CheckpointError):
    """A checkpoint whose files verify but whose state does not fit the live run (another config, not damage)."""


class RunFileError(CheckpointError):
    """A run's own file (run.json, metrics.jsonl) that is damaged; refused like a damaged checkpoint."""

    kind = "run"
