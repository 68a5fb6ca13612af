"""The resume stage: continue from the newest checkpoint that verifies, or from a given one, refusing drift."""
from __future__ import annotations

import logging
from pathlib import Path

from pipeline.stages.base import Stage

log = logging.getLogger("pipeline")
AUTO, NEVER = "auto", "never"


class Resume(Stage):
    name = "resume"

    def __init__(self, source: str, allow_changes: list[str], order: int):
        super().__init__(order)
        self.source, self.allow_changes = str(source), [str(k) for k in (allow_changes or [])]

    def setup(self, run) -> None:
        if self.source == NEVER:
            run.start_fresh()
        elif self.source == AUTO:
            run.resume_own(self.allow_changes)
        else:
            run.resume_from_source(Path(self.source).expanduser(), self.allow_changes)
