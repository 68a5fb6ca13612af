"""The mlflow tracker the training process holds: every call enqueues and returns; mlflow lives in an agent.

The agent (`pipeline/tracking/agent.py`) is a helper process started by the first `start()` of a process and
kept for the next jobs that process runs (the basic launcher and joblib's workers run several): it imports
mlflow, opens the store, finds or creates the run, and logs in batches (`MlflowClient.log_batch`, up to 1000
metrics a call) while training goes on. This module never imports mlflow.

One mlflow run per run directory: a resumed job continues its run (found by the run URI its checkpoint
recorded, or by the `run_dir` tag), with a `resumes` counter and a `resume.<n>` = step tag for each resume.
A tracking failure (mlflow missing, store unwritable or locked, server down) logs one warning and turns
tracking off for the rest of the run; training and its manifests go on, and `python -m pipeline.reindex`
can index them later.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from pipeline.tracking.base import Tracker
from pipeline.tracking.common import (CURRENT_JOB, artifact_location_uri, normalize_tracking_uri, params_of,
                                      project_pythonpath, step_of_checkpoint, tags_of)

log = logging.getLogger("pipeline")
agent_log = logging.getLogger("pipeline.tracking.agent")


class _AgentProcess:
    """The training process's end of the agent: a queue, a writer thread, and a reader of the agent's replies."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=project_pythonpath())
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.tracking.agent"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True)
        self.queue: queue.Queue = queue.Queue()
        self.sessions: dict[int, MlflowTracker] = {}
        self.ids = itertools.count(1)
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.dead: str | None = None
        self.lock = threading.Lock()
        for target in (self._write, self._read, self._read_stderr):
            threading.Thread(target=target, daemon=True, name=f"tracking-{target.__name__[1:]}").start()

    def alive(self) -> bool:
        return self.dead is None and self.proc.poll() is None

    def open(self, tracker: "MlflowTracker", payload: dict) -> int:
        with self.lock:
            sid = next(self.ids)
            self.sessions[sid] = tracker
        self.send({"op": "open", "sid": sid, **payload})
        return sid

    def send(self, msg: dict | None) -> None:
        self.queue.put(msg)

    def _write(self) -> None:
        stdin = self.proc.stdin
        try:
            while True:
                batch = [self.queue.get()]
                while True:
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                out, closing = [], False
                for msg in batch:
                    if msg is None:
                        closing = True
                        break
                    last = out[-1] if out else None
                    if msg["op"] == "metrics" and last and last["op"] == "metrics" and last["sid"] == msg["sid"]:
                        last["lines"] = last["lines"] + msg["lines"]  # consecutive lines travel together
                    else:
                        out.append(msg)
                if out:
                    stdin.write("".join(json.dumps(m, allow_nan=True) + "\n" for m in out).encode())
                    stdin.flush()
                if closing:
                    stdin.close()
                    return
        except (OSError, ValueError) as e:
            self._died(f"the tracking agent stopped reading ({e})")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except json.JSONDecodeError:
                continue
            tracker = self.sessions.get(event.get("sid"))
            if tracker is not None:
                tracker._on_event(event)
                if event.get("event") in ("finished", "error"):
                    with self.lock:
                        self.sessions.pop(event["sid"], None)
        rc = self.proc.wait()
        self._died(f"the tracking agent exited (code {rc})")

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.stderr_tail.append(line)
            agent_log.debug("%s", line)

    def _died(self, reason: str) -> None:
        if self.dead is None:
            tail = " | ".join(line for line in list(self.stderr_tail)[-3:] if line.strip())
            self.dead = reason + (f": {tail}" if tail else "")
        with self.lock:
            orphans, self.sessions = list(self.sessions.values()), {}
        for tracker in orphans:
            tracker._on_event({"event": "error", "message": self.dead})

    def close(self, timeout: float = 5.0) -> None:
        """End of the process: end the agent's input; it exits once it has written what it holds."""
        self.send(None)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # it finishes on its own (it ignores SIGINT/SIGTERM and ends with its input)


_AGENT: _AgentProcess | None = None
_AGENT_LOCK = threading.Lock()


def _agent() -> _AgentProcess:
    global _AGENT
    with _AGENT_LOCK:
        if _AGENT is None or not _AGENT.alive():
            _AGENT = _AgentProcess()
            atexit.register(_AGENT.close)
        return _AGENT


class MlflowTracker(Tracker):
    """conf/tracking/mlflow.yaml (sqlite under the output directory) and conf/tracking/server.yaml (http)."""

    def __init__(self, uri: str, experiment: str = "default", artifact_location: str | None = None,
                 flush_timeout: float = 60.0, **_):
        self.uri = normalize_tracking_uri(uri)
        self.experiment = str(experiment)
        self.artifact_location = artifact_location_uri(artifact_location) if artifact_location else None
        self.flush_timeout = float(flush_timeout)
        self.sid: int | None = None
        self.agent: _AgentProcess | None = None
        self.ready, self.done = threading.Event(), threading.Event()
        self._uri: str | None = None
        self.failed = self.finished = False
        self._warned = threading.Lock()

    @property
    def active(self) -> bool:
        return self.sid is not None and not self.failed and not self.finished

    def start(self, *, config: dict, facts: dict, run_dir: Path, previous_run_uri: str | None) -> None:
        CURRENT_JOB["tracker"] = self
        parent = CURRENT_JOB.get("parent")
        payload = {
            "uri": self.uri, "experiment": self.experiment, "artifact_location": self.artifact_location,
            "run_dir": str(Path(run_dir).resolve()), "params": params_of(config), "tags": tags_of(facts, run_dir),
            "previous_run_uri": previous_run_uri, "resume_step": step_of_checkpoint(facts.get("resumed_from")),
            "parent": parent if parent and parent.get("uri") == self.uri else None,
        }
        try:
            self.agent = _agent()
            self.sid = self.agent.open(self, payload)
        except Exception as e:  # noqa: BLE001 - tracking never stops training
            self._fail(f"could not start the tracking agent: {e}")

    def _on_event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "ready":
            self._uri = event["uri"]
            self.ready.set()
        elif kind == "error":
            self._fail(event.get("message", "unknown error"))
        elif kind == "finished":
            self.done.set()

    def _fail(self, reason: str) -> None:
        if self._warned.acquire(blocking=False):
            self.failed = True
            log.warning("mlflow tracking (%s) is off for the rest of this run: %s. Training goes on and the "
                        "manifests are written; index them later with `python -m pipeline.reindex`.",
                        self.uri, reason)
        self.ready.set()
        self.done.set()

    def run_uri(self, timeout: float) -> str | None:
        if self.sid is None or self.failed:
            return None
        if self._uri is None and timeout > 0:
            self.ready.wait(timeout)
        return None if self.failed else self._uri

    def log_line(self, line: dict) -> None:
        if self.active:
            self.agent.send({"op": "metrics", "sid": self.sid, "lines": [line]})

    def log_checkpoint(self, directory: Path, manifest: dict) -> None:
        if not self.active:
            return
        try:
            text = (Path(directory) / "manifest.json").read_text()  # the bytes on disk, not a re-serialisation
        except OSError:
            text = json.dumps(manifest, indent=2, sort_keys=True)
        self.agent.send({"op": "checkpoint", "sid": self.sid, "step": int(manifest["step"]), "manifest": text})

    def finish(self, status: str, run_dir: Path) -> None:
        if not self.active:
            return
        self.agent.send({"op": "finish", "sid": self.sid, "status": status, "run_dir": str(Path(run_dir).resolve())})
        self.finished = True
        if not self.done.wait(self.flush_timeout):
            log.warning("mlflow tracking (%s) did not flush within %.0f s; it goes on in the background. If the "
                        "run is incomplete in mlflow, `python -m pipeline.reindex` completes it from disk.",
                        self.uri, self.flush_timeout)
