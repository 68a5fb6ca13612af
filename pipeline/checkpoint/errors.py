"""The one error a reader of a checkpoint sees: directory, file and reason in one line."""
from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    def __init__(self, directory: Path | str, file: str, reason: str):
        self.directory, self.file, self.reason = Path(directory), file, reason
        super().__init__(f"checkpoint {self.directory}: {file}: {reason}")
