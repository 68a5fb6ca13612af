"""The mlflow tracker the training process holds: every call enqueues and returns; mlflow lives in the agent.

The agent (pipeline/tracking/agent.py) is one helper process per machine and tracking URI, found or started
by pipeline/tracking/link.py as soon as the job knows its URI (before building the data and the model), so
`import mlflow` and opening the store overlap with the job's own start. It finds or creates the run, logs
metrics in batches while training goes on, and at the end indexes the whole run directory (the same code
as `pipeline.reindex`). One mlflow run per run directory: a resumed job continues its run.

The job waits for tracking twice, both bounded: for the run's URI at its last checkpoint (so the final
manifest names its run), and for the final flush (`flush_timeout`); if the agent is still writing then,
the job says so in one line and the agent finishes on its own (`python -m pipeline.reindex` completes
anything it could not). A tracking failure (mlflow missing, store unusable, server down) warns once and
turns tracking off for the rest of the run; training and its manifests go on.
"""
from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path

from pipeline.tracking.base import Tracker
from pipeline.tracking.common import CURRENT_JOB, artifact_location_uri, normalize_tracking_uri, params_of, tags_of

log = logging.getLogger("pipeline")


def agent_log(uri: str) -> Path:
    from pipeline.tracking.link import socket_path

    return Path(tempfile.gettempdir()) / (socket_path(uri).stem + ".log")


class MlflowTracker(Tracker):
    """conf/tracking/mlflow.yaml (sqlite under the output directory) and conf/tracking/server.yaml (http)."""

    def __init__(self, uri: str, experiment: str = "default", artifact_location: str | None = None,
                 flush_timeout: float = 20.0, uri_timeout: float = 120.0, **_):
        self.uri = normalize_tracking_uri(uri)
        self.experiment = str(experiment)
        local = not self.uri.startswith(("http://", "https://", "databricks"))
        self.artifact_location = artifact_location_uri(artifact_location) if artifact_location and local else None
        self.flush_timeout, self.uri_timeout = float(flush_timeout), float(uri_timeout)
        self.sid: int | None = None
        self.link = None
        self.ready, self.done = threading.Event(), threading.Event()
        self._uri: str | None = None
        self.failed = self.finished = False
        self._warned = threading.Lock()
        self.job = CURRENT_JOB.get("job")
        self.parent = CURRENT_JOB.get("parent")

    @property
    def active(self) -> bool:
        return self.sid is not None and not self.failed and not self.finished

    def prepare(self) -> None:
        """Find or start the agent now, and have it open the store, while the job builds its data and model."""
        if CURRENT_JOB.get("disabled"):
            self.failed = True  # the sweep said why, once
            return
        try:
            from pipeline.tracking.link import agent_for

            self.link = agent_for(self.uri, agent_log(self.uri))
            self.link.send({"op": "ping", "sid": self.link.register(_Ignore()), "uri": self.uri,
                            "artifact_location": self.artifact_location})
        except OSError as e:
            self._fail(f"no tracking agent: {e}")

    def start(self, *, config: dict, facts: dict, run_dir: Path, previous_run_uri: str | None,
              status: dict | None = None, start_time: float | None = None) -> None:
        if self.failed:
            return
        if self.link is None:
            self.prepare()
            if self.failed:
                return
        log.info("mlflow: tracking into %s (experiment %s)", self.uri, self.experiment)
        self.sid = self.link.register(self)
        self.link.send({"op": "open", "sid": self.sid, "uri": self.uri, "experiment": self.experiment,
                        "artifact_location": self.artifact_location, "run_dir": str(Path(run_dir).resolve()),
                        "params": params_of(config), "tags": tags_of(facts, run_dir, status, self.job),
                        "previous_run_uri": previous_run_uri, "start_time": start_time, "parent": self.parent})

    def attach(self, run_dir: Path) -> str | None:
        """A sweep job whose run was complete before it started: index it under the sweep, and wait for it."""
        if self.failed or self.parent is None:
            return None
        if self.link is None:
            self.prepare()
            if self.failed:
                return None
        answer = self.link.request({"op": "attach", "uri": self.uri, "artifact_location": self.artifact_location,
                                    "run_dir": str(Path(run_dir).resolve()), "parent": self.parent, "job": self.job},
                                   self.uri_timeout)
        if not answer or answer.get("event") != "finished":
            self._fail((answer or {}).get("message", f"no answer within {self.uri_timeout:.0f} s"))
            return None
        return answer.get("uri")

    def on_event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "ready":
            self._uri = event["uri"]
            log.info("mlflow: run %s", self._uri)
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
                self.ready.set()
                self.done.set()
                return
            log.warning("mlflow tracking (%s) is off for the rest of this run: %s. Training goes on and the "
                        "manifests are written; index them later with `python -m pipeline.reindex`.",
                        self.uri, reason)
        self.ready.set()
        self.done.set()

    def run_uri(self, timeout: float) -> str | None:
        if self.sid is None or self.failed:
            return None
        if self._uri is None and timeout > 0:
            self.ready.wait(min(timeout, self.uri_timeout))
        return None if self.failed else self._uri

    def log_line(self, line: dict) -> None:
        if self.active:
            self.link.send({"op": "metrics", "sid": self.sid, "lines": [line]})

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        if not self.active:
            return
        try:
            text = (Path(directory) / "manifest.json").read_text()  # the bytes on disk, not a re-serialisation
        except OSError:
            return
        self.link.send({"op": "checkpoint", "sid": self.sid, "step": int(manifest["step"]), "manifest": text})

    def finish(self, status: str, run_dir: Path) -> None:
        """Index the run directory as it now is (status from run.json), waiting at most flush_timeout."""
        if not self.active:
            return
        self.link.send({"op": "finish", "sid": self.sid, "run_dir": str(Path(run_dir).resolve()),
                        "parent": self.parent, "job": self.job})
        self.finished = True
        if not self.done.wait(self.flush_timeout):
            log.warning("mlflow: run %s is still being written (its last metric points and artifacts); the "
                        "tracking agent finishes it after this job exits, and `python -m pipeline.reindex` "
                        "completes it if it cannot", self._uri or "(not created yet)")


class _Ignore:
    def on_event(self, event: dict) -> None:
        pass
