"""The mlflow tracker the training process holds: every call enqueues and returns; mlflow lives in the agent."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from pathlib import Path

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.checkpoint.errors import CheckpointError
from pipeline.run.report import run_page
from pipeline.run.sweep import SweepJob
from pipeline.run.tracker import Tracker
from pipeline.tracking import common, link
from pipeline.tracking.link import Link, Request, request
from pipeline.tracking.sweep_parent import MlflowSweepParent

log = logging.getLogger("pipeline")
OFF = "mlflow tracking (%s) is off for the rest of this run: %s. Training goes on and the "
OFF += "manifests are written; index them later with `python -m pipeline.reindex`."
WAITED = "mlflow: this job waited %.3f s on tracking in all (bound %.1f s); the tracking agent "
WAITED += "finishes run %s after it exits%s%s"
LATE = " (its last messages were not sent in time: `python -m pipeline.reindex` completes the run)"
SLURM = f" (inside a SLURM job, which waits for it at its exit, at most {common.SLURM_WAIT:.0f} s)"


def wait_at_exit(event: threading.Event, what: str) -> None:
    """Inside a SLURM job: at exit, wait at most SLURM_WAIT for `event`, the agent's answer for `what`."""
    said = "mlflow: the tracking agent did not complete %s within %.0f s of this SLURM job's end; "
    said += "`python -m pipeline.reindex` completes it"

    def wait() -> None:
        if not event.wait(common.SLURM_WAIT):
            log.warning(said, what, common.SLURM_WAIT)

    atexit.register(wait)


class MlflowTracker(Tracker):
    """conf/tracking/{mlflow,server}.yaml: a job waits at most `wait` s in all; a failure warns once, tracking off."""

    sweep_parent = MlflowSweepParent

    def __init__(self, uri: str, experiment: str, artifact_location, wait: float, sweep=None, **_):
        self.uri, self.experiment = common.normalize_tracking_uri(uri), str(experiment)
        self.artifact_location = common.artifact_root(self.uri, artifact_location)
        self.wait, self.waited = float(wait), 0.0  # waited: on tracking so far (at most self.wait)
        self.sid: int | None = None
        self._link: Link | None = None  # the agent's, once started (prepare)
        self.ready, self.done, self.warm = threading.Event(), threading.Event(), threading.Event()
        self._uri: str | None = None
        self.failed = self.finished = False
        self._warned, self._store_warned = threading.Lock(), threading.Lock()  # each said once
        sweep = sweep or SweepJob()  # job: its run's tags; off: why the sweep turned it off
        self.job, self.parent, self.off = sweep.tags, sweep.parent, sweep.tracking_off

    def _wait_for(self, wait, timeout: float):
        """wait(seconds) (an event's wait, a drain, a check), within what is left of the job's bound."""
        t0 = time.monotonic()
        try:
            return wait(max(0.0, min(timeout, self.wait - self.waited)))
        finally:
            self.waited += time.monotonic() - t0

    @property
    def active(self) -> bool:
        return self.sid is not None and not self.failed and not self.finished

    def prepare(self) -> None:
        """Find or start the agent now, and have it open the store, while the job builds its data and model."""
        if self.off:
            self.failed = True
            return
        problem = self._wait_for(lambda t: common.store_problem(self.uri, timeout=t), self.wait / 2)
        if problem:
            self._fail(problem)
            return
        try:
            pong = Request(kinds=("pong",), heard=self._heard)
            self.warm = pong.done  # the agent has the store open: a run's URI is moments away
            self._link = link.agent_for(self.uri)  # looked up at each call: a test may replace it
            where = {"uri": self.uri, "artifact_location": self.artifact_location}
            request(self._link, "ping", pong, **where)
        except OSError as e:
            self._fail(f"no tracking agent: {e}")

    def _linked(self) -> bool:
        """Whether tracking is on, the agent found or started now if prepare() was not called."""
        if self._link is None and not self.failed:
            self.prepare()
        return not self.failed

    @property
    def link(self) -> Link:
        assert self._link is not None, "the agent is used before prepare() linked it"
        return self._link

    def start(
        self, *, config: dict, facts: dict, run_dir, previous_run_uri, status=None, start_time=None
    ):
        if not self._linked():
            return
        log.info("mlflow: tracking into %s (experiment %s)", self.uri, self.experiment)
        self.sid = self.link.register(self)
        tags, params = common.tags_of(facts, run_dir, status, self.job), common.params_of(config)
        said = dict(experiment=self.experiment, params=params, tags=tags, start_time=start_time)
        self._send("open", **self._where(run_dir), **said, previous_run_uri=previous_run_uri)

    def _send(self, op: str, **fields) -> None:
        self.link.send({"op": op, "sid": self.sid, **fields})

    def _where(self, run_dir: Path) -> dict:
        """What every request about this job's run says: its store, run directory and sweep."""
        where = {"uri": self.uri, "artifact_location": self.artifact_location, "job": self.job}
        return {**where, "parent": self.parent, "run_dir": str(Path(run_dir).resolve())}

    def attach(self, run_dir: Path) -> str | None:
        """A sweep job's run done before it started: indexed under the sweep; its URI if the agent answers in time."""
        if self.parent is None or not self._linked():
            return None
        req = request(self.link, "attach", **self._where(run_dir))
        if os.environ.get("SLURM_JOB_ID"):
            wait_at_exit(req.done, f"the sweep's record of run {run_dir}")
        self._wait_for(req.done.wait, self.wait)
        self.link.drain(self.wait - self.waited)
        if req.event and req.event.get("event") == "error":
            self._fail(req.event.get("message", "unknown error"))
        return (req.event or {}).get("uri")

    def _heard(self, event: dict) -> None:
        """What the agent says of the store (it opens it, in its own process), on this job's output once."""
        if event.get("warning") and self._store_warned.acquire(blocking=False):
            log.warning("mlflow: %s", event["warning"])

    def on_event(self, event: dict) -> None:
        self._heard(event)
        kind = event.get("event")
        if kind == "ready":
            self._uri, self.experiment_id = event["uri"], event.get("experiment_id")
            log.info("mlflow: run %s", run_page(self._uri))
            self.ready.set()
        elif kind == "error":
            self._fail(event.get("message", "unknown error"))
        elif kind == "finished":
            self.done.set()

    def _fail(self, reason: str) -> None:
        if self._warned.acquire(blocking=False):
            self.failed = True
            if self.job is not None:  # a sweep's job: the sweep says it once, at its end
                log.debug("mlflow tracking (%s) is off for this job: %s", self.uri, reason)
            else:
                log.warning(OFF, self.uri, reason)
        self.ready.set()
        self.done.set()

    def run_uri(self, timeout: float) -> str | None:
        """The run's URI, waited for (at most half the bound) only if the agent has the store open (warm)."""
        if self.sid is None or self.failed:
            return None
        if self._uri is None and timeout > 0 and self.warm.is_set():
            self._wait_for(self.ready.wait, min(timeout, self.wait / 2 - self.waited))
        return None if self.failed else self._uri

    def log_line(self, line: dict) -> None:
        if self.active:
            self._send("metrics", lines=[line])

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        if not self.active:
            return
        try:  # the bytes on disk, not a re-serialisation
            name, raw = CheckpointDir(directory).manifest_file()
        except CheckpointError:
            return
        artifact = f"{Path(directory).parent.name}/{Path(directory).name}/{name}"  # as in the run
        self._send("checkpoint", artifact=artifact, manifest=raw.decode())

    def finish(self, status: str, run_dir: Path) -> None:
        """Hand the run over and leave, waiting within the bound for the last messages to go (in SLURM, at exit too)."""
        if not self.active:
            return
        self._send("finish", **self._where(run_dir), pid=os.getpid())
        self.finished = True
        if at_exit := status != "KILLED" and os.environ.get("SLURM_JOB_ID"):
            wait_at_exit(self.done, f"run {self._uri or run_dir}")
        late = "" if self._wait_for(self.link.drain, self.wait) else LATE
        page = run_page(self._uri) if self._uri else "(not created yet)"
        log.info(WAITED, self.waited, self.wait, page, late, SLURM if at_exit else "")
