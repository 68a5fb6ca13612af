"""One job of a multirun, as an object the job runner passes on: who it is in its sweep, and its record at its end."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config.errors import EXIT_PREEMPTED, CommandError
from pipeline.files import jsonio
from pipeline.files.atomic import ensure_dirs, replace_file

log = logging.getLogger("pipeline")


class SweepInterrupted(CommandError):
    """What a job of an interrupted sweep raises after its record: every sweeper stops there, the sweep exits 75."""

    exit_code = EXIT_PREEMPTED


@dataclass
class SweepJob:
    """Built from its sweep's sweep.json (sweep/callback.job_of); `dir` None: no sweep callback, no record."""

    dir: Path | None = None
    sweep_id: str | None = None
    num: int = 0  # Hydra's job number, plus the trials an Optuna study held before this launch
    overrides: list[str] = field(default_factory=list)
    name: str = ""  # the swept values, as a person reads them
    parallel: bool = False  # jobs side by side (joblib): its console lines carry `[job <num>]`
    parent: dict | None = None  # {"sweep_id"}: how the agent finds the parent run (None: untracked)
    tracking_off: str | None = None  # why the sweep is untracked (its launcher said so, once)
    started: float | None = None
    run_dir: str | None = None  # set by the job runner as it learns them
    run_uri: str | None = None
    failure: dict | None = None  # {"code", "error"}, and {"status": "not started"} if never begun
    unreadable: str | None = None  # why its sweep.json does not read: the job fails as bad input

    @property
    def tags(self) -> dict | None:
        """What the job's tracked run and its record say about it; None outside a recorded sweep."""
        if self.dir is None:
            return None
        return dict(sweep_id=self.sweep_id, num=self.num, overrides=self.overrides, name=self.name)

    def record(self, objective: object = None, error: BaseException | None = None) -> None:
        """<sweep dir>/jobs/<num>.json at the job's end (an exception out of the job: code 1 and its text)."""
        if self.dir is None:
            return
        if error is not None and self.failure is None:
            self.failure = {"code": 1, "error": f"{type(error).__name__}: {error}"[:2000]}
        failure = self.failure or {}
        value = float(objective) if isinstance(objective, (int, float)) and error is None else None
        code = failure.get("code")
        status = "complete" if code is None else "preempted" if code == EXIT_PREEMPTED else "failed"
        record = dict(self.tags or {}, run_dir=self.run_dir, run_uri=self.run_uri, objective=value)
        record.update(started=self.started, ended_at=time.time(), status=status)
        record.update(failure)  # its status ("not started") says more than `status`
        try:
            replace_file(ensure_dirs(self.dir, "jobs") / f"{self.num}.json", jsonio.dumps(record))
        except OSError as e:
            log.warning("could not record job %s in %s: %s", self.num, self.dir, e)
