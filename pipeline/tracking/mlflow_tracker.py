"""The mlflow tracker the training process holds: every call enqueues and returns; mlflow lives in an agent.

The agent (`pipeline/tracking/agent.py`) is a helper process: in a multirun the one the sweep callback
started (jobs connect to its Unix socket), otherwise one started by the first `start()` of the process and
kept for the next jobs it runs. It imports mlflow, opens the store, finds or creates the run, and logs in
batches (`MlflowClient.log_batch`, up to 1000 metrics a call, at most one commit a second) while training
goes on. This module never imports mlflow.

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
import socket
import subprocess
import sys
import threading
from pathlib import Path

from pipeline.tracking.base import Tracker
from pipeline.tracking.common import (CURRENT_JOB, artifact_location_uri, normalize_tracking_uri, params_of,
                                      project_pythonpath, tags_of)

log = logging.getLogger("pipeline")
agent_log = logging.getLogger("pipeline.tracking.agent")


class _Link:
    """A connection to an agent: messages go through a queue and a writer thread, replies are dispatched by a
    reader thread to whoever sent the request (a tracker, or a _Request of the sweep callback)."""

    def __init__(self, wfile, rfile, proc: subprocess.Popen | None = None, name: str = "agent"):
        self.wfile, self.rfile, self.proc, self.name = wfile, rfile, proc, name
        self.queue: queue.Queue = queue.Queue()
        self.handlers: dict[int, object] = {}
        self.ids = itertools.count(1)
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.dead: str | None = None
        self.lock = threading.Lock()
        targets = [self._write, self._read] + ([self._read_stderr] if proc is not None else [])
        for target in targets:
            threading.Thread(target=target, daemon=True, name=f"tracking{target.__name__}").start()

    @classmethod
    def spawn(cls, listen: str | None = None, priority: str = "10") -> "_Link":
        env = dict(os.environ, PYTHONPATH=project_pythonpath())
        cmd = [sys.executable, "-m", "pipeline.tracking.agent", "--priority", str(priority)]
        cmd += ["--listen", listen] if listen else []
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, close_fds=True)
        return cls(proc.stdin, proc.stdout, proc)

    @classmethod
    def connect(cls, path: str) -> "_Link":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.connect(path)
        sock.settimeout(None)
        link = cls(sock.makefile("wb"), sock.makefile("rb"), name=f"sweep agent {path}")
        link.sock = sock
        return link

    def alive(self) -> bool:
        return self.dead is None and (self.proc is None or self.proc.poll() is None)

    def register(self, handler) -> int:
        with self.lock:
            sid = next(self.ids)
            self.handlers[sid] = handler
        return sid

    def send(self, msg: dict | None) -> None:
        self.queue.put(msg)

    def request(self, msg: dict, timeout: float) -> dict | None:
        """Send one request and wait for its answer (an event dict), or None after `timeout` seconds."""
        req = _Request()
        self.send({**msg, "sid": self.register(req)})
        return req.event if req.done.wait(timeout) else None

    def _write(self) -> None:
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
                    self.wfile.write("".join(json.dumps(m) + "\n" for m in out).encode())
                    self.wfile.flush()
                if closing:
                    self.wfile.close()
                    return
        except (OSError, ValueError) as e:
            self._died(f"the {self.name} stopped reading ({e})")

    def _read(self) -> None:
        try:
            for raw in self.rfile:
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                handler = self.handlers.get(event.get("sid"))
                if handler is not None:
                    handler._on_event(event)
                    if event.get("event") in ("finished", "error"):
                        with self.lock:
                            self.handlers.pop(event["sid"], None)
        except (OSError, ValueError):
            pass
        code = f" (code {self.proc.wait()})" if self.proc is not None else ""
        self._died(f"the {self.name} exited{code}")

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
            orphans, self.handlers = list(self.handlers.values()), {}
        for handler in orphans:
            handler._on_event({"event": "error", "message": self.dead})

    def close(self, timeout: float = 5.0) -> None:
        """End the agent's input; a spawned agent exits once it has written what it holds."""
        self.send(None)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass  # it finishes on its own (it ignores SIGINT/SIGTERM and ends with its input)


class _Request:
    def __init__(self):
        self.done = threading.Event()
        self.event: dict | None = None

    def _on_event(self, event: dict) -> None:
        self.event = event
        self.done.set()


_OWN: _Link | None = None  # this process's own agent (single runs; jobs that cannot reach a sweep agent)
_SWEEP: dict[str, _Link] = {}  # connections to sweep agents, by socket path (a joblib worker runs many jobs)
_LINKS_LOCK = threading.Lock()


def own_agent(priority: str = "10") -> _Link:
    global _OWN
    with _LINKS_LOCK:
        if _OWN is None or not _OWN.alive():
            _OWN = _Link.spawn(priority=priority)
            atexit.register(_OWN.close)
        return _OWN


def sweep_agent(path: str | None) -> _Link | None:
    """A connection to the sweep's agent, or None when it cannot be reached (another node, or gone)."""
    if not path:
        return None
    with _LINKS_LOCK:
        link = _SWEEP.get(path)
        if link is None or not link.alive():
            try:
                link = _SWEEP[path] = _Link.connect(path)
            except OSError:
                return None
        return link


def link_for(parent: dict | None, priority: str = "10") -> _Link:
    return sweep_agent((parent or {}).get("agent")) or own_agent(priority)


class MlflowTracker(Tracker):
    """conf/tracking/mlflow.yaml (sqlite under the output directory) and conf/tracking/server.yaml (http)."""

    def __init__(self, uri: str, experiment: str = "default", artifact_location: str | None = None,
                 flush_timeout: float = 60.0, priority: str | int = 10, **_):
        self.uri = normalize_tracking_uri(uri)
        self.experiment = str(experiment)
        self.artifact_location = artifact_location_uri(artifact_location) if artifact_location else None
        self.flush_timeout = float(flush_timeout)
        self.priority = str(priority)
        self.sid: int | None = None
        self.agent: _Link | None = None
        self.ready, self.done = threading.Event(), threading.Event()
        self._uri: str | None = None
        self.failed = self.finished = False
        self._warned = threading.Lock()

    @property
    def active(self) -> bool:
        return self.sid is not None and not self.failed and not self.finished

    def start(self, *, config: dict, facts: dict, run_dir: Path, previous_run_uri: str | None,
              resumed_at: int | None = None) -> None:
        CURRENT_JOB["tracker"] = self
        parent = CURRENT_JOB.get("parent")
        payload = {
            "uri": self.uri, "experiment": self.experiment, "artifact_location": self.artifact_location,
            "run_dir": str(Path(run_dir).resolve()), "params": params_of(config), "tags": tags_of(facts, run_dir),
            "previous_run_uri": previous_run_uri, "resume_step": resumed_at,
            "parent": parent if parent and parent.get("uri") == self.uri else None,
        }
        try:
            self.agent = link_for(parent, self.priority)
            self.sid = self.agent.register(self)
            self.agent.send({"op": "open", "sid": self.sid, **payload})
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
