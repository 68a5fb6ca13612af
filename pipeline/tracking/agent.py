"""`python -m pipeline.tracking.agent`: the helper process that talks to mlflow for a training process.

Why a process and not a thread: `import mlflow` (~3.5 s) and opening a sqlite store (1-3 s) are Python work
that holds the GIL; in a thread of the training process they stalled a 1.5 s training run to 5.7 s. Here they
run on another core while training goes on, and the training process only ever enqueues.

Protocol: JSON lines. In (stdin), each with a session id `sid` (one per tracked job; a process running several
jobs, e.g. a joblib worker, keeps one agent):
  {"op": "open", "sid", "uri", "artifact_location", "experiment", "run_dir", "params", "tags",
   "previous_run_uri", "resume_step", "parent": {"uri", "experiment_id", "run_id"} | null}
  {"op": "metrics", "sid", "lines": [metrics.jsonl lines]}
  {"op": "checkpoint", "sid", "step", "manifest": "<manifest.json text>"}
  {"op": "finish", "sid", "status", "run_dir"}
Out (stdout): {"sid", "event": "ready", "uri", "run_id", "experiment_id"} | {"sid", "event": "error", "message"}
| {"sid", "event": "finished"}. End of input: every session still open is flushed and ended FAILED.
A session whose mlflow call fails reports one error and is dropped; the others go on.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

MAX_PENDING = 1000


class Session:
    def __init__(self, sid: int):
        self.sid = sid
        self.client = None
        self.run_id: str | None = None
        self.logged: set = set()  # (key, step) already in mlflow (a resumed run): not logged again
        self.pending: list = []
        self.failed = False


class Agent:
    def __init__(self, out, import_error: str | None):
        self.out, self.import_error = out, import_error
        self.sessions: dict[int, Session] = {}
        self.clients: dict[str, object] = {}

    def reply(self, sid: int, event: str, **fields) -> None:
        self.out.write(json.dumps({"sid": sid, "event": event, **fields}) + "\n")
        self.out.flush()

    def fail(self, s: Session, e: BaseException | str) -> None:
        if not s.failed:
            s.failed = True
            msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}".strip()
            if not isinstance(e, str):
                traceback.print_exception(e, file=sys.stderr)
            self.reply(s.sid, "error", message=msg[:2000])

    def client(self, uri: str):
        from pipeline.tracking import store

        if uri not in self.clients:
            self.clients[uri] = store.open_client(uri)
        return self.clients[uri]

    # --- ops
    def open(self, m: dict) -> None:
        s = self.sessions[m["sid"]] = Session(m["sid"])
        if self.import_error:
            return self.fail(s, f"mlflow could not be imported: {self.import_error}")
        from pipeline.tracking import store
        from pipeline.tracking.common import parse_run_uri, run_uri

        uri, run_dir = m["uri"], m["run_dir"]
        s.client = client = self.client(uri)
        parent = m.get("parent")
        if parent and parent.get("uri") == uri:
            experiment_id = parent["experiment_id"]
        else:
            parent = None
            experiment_id = store.ensure_experiment(client, m["experiment"], m.get("artifact_location"))
        prev_uri, _, prev_id = parse_run_uri(m.get("previous_run_uri"))
        candidates = [prev_id] if prev_id and prev_uri in (None, uri) else []
        run = store.find_run(client, run_dir, candidates)
        tags = dict(m["tags"])
        if parent:
            tags["mlflow.parentRunId"] = parent["run_id"]
        if run is None:
            if m.get("previous_run_uri"):
                tags["continued_from"] = m["previous_run_uri"]  # a fork, or a run indexed in another store
            run = store.create_run(client, experiment_id, tags)
        else:
            s.logged = store.logged_steps(client, run.info.run_id, run.data.metrics.keys())
            if m.get("resume_step") is not None:
                n = int(run.data.tags.get("resumes", "0")) + 1
                tags["resumes"] = str(n)
                tags[f"resume.{n}"] = str(m["resume_step"])
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            store.sync_tags(client, run, tags)
        store.sync_params(client, run, m["params"])
        s.run_id = run.info.run_id
        self.reply(s.sid, "ready", uri=run_uri(uri, run.info.experiment_id, s.run_id), run_id=s.run_id,
                   experiment_id=run.info.experiment_id)

    def metrics(self, s: Session, m: dict) -> None:
        from pipeline.tracking.common import metric_points

        for line in m["lines"]:
            s.pending += [p for p in metric_points(line) if (p[0], p[3]) not in s.logged]
        if len(s.pending) >= MAX_PENDING:
            self.flush(s)

    def flush(self, s: Session) -> None:
        if s.pending and not s.failed:
            from pipeline.tracking import store

            points, s.pending = s.pending, []
            store.log_points(s.client, s.run_id, points)

    def checkpoint(self, s: Session, m: dict) -> None:
        from pipeline.tracking import store

        self.flush(s)
        store.log_file_as(s.client, s.run_id, f"checkpoints/step-{int(m['step']):08d}/manifest.json",
                          data=m["manifest"].encode())

    def finish(self, s: Session, m: dict) -> None:
        from pipeline.tracking import store
        from pipeline.tracking.common import FINAL_MANIFEST_ARTIFACT, FINAL_WEIGHTS_ARTIFACT

        self.flush(s)
        run_dir = Path(m["run_dir"])
        store.log_curves(s.client, s.run_id, store.read_lines(run_dir / "metrics.jsonl"))
        final = run_dir / "checkpoints" / "final"
        if m["status"] == "FINISHED" and (final / "weights.safetensors").is_file():
            store.log_file_as(s.client, s.run_id, FINAL_WEIGHTS_ARTIFACT, source=final / "weights.safetensors")
            store.log_file_as(s.client, s.run_id, FINAL_MANIFEST_ARTIFACT, source=final / "manifest.json")
        s.client.set_terminated(s.run_id, status=m["status"], end_time=int(time.time() * 1000))
        self.reply(s.sid, "finished")

    def handle(self, m: dict) -> None:
        if m["op"] == "open":
            try:
                self.open(m)
            except Exception as e:  # noqa: BLE001 - any tracking failure is reported, never raised
                self.fail(self.sessions[m["sid"]], e)
            return
        s = self.sessions.get(m["sid"])
        if s is None or s.failed:
            if m["op"] == "finish":
                self.reply(m["sid"], "finished")
            return
        try:
            getattr(self, m["op"])(s, m)
        except Exception as e:  # noqa: BLE001
            self.fail(s, e)
        if m["op"] == "finish":
            self.sessions.pop(s.sid, None)

    def end_of_input(self) -> None:
        """The training process went away without finishing: keep what was sent, end the runs FAILED."""
        for s in list(self.sessions.values()):
            if s.failed or s.run_id is None:
                continue
            try:
                self.flush(s)
                s.client.set_tag(s.run_id, "ended", "the training process exited without finishing the run")
                s.client.set_terminated(s.run_id, status="FAILED", end_time=int(time.time() * 1000))
            except Exception as e:  # noqa: BLE001
                traceback.print_exception(e, file=sys.stderr)

    def loop(self, inbox: queue.Queue) -> None:
        while True:
            batch = [inbox.get()]
            while len(batch) < 5000:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for m in batch:
                if m is None:
                    for s in self.sessions.values():
                        self._safe_flush(s)
                    self.end_of_input()
                    return
                self.handle(m)
            for s in self.sessions.values():  # the queue ran dry: write what is pending
                self._safe_flush(s)

    def _safe_flush(self, s: Session) -> None:
        try:
            self.flush(s)
        except Exception as e:  # noqa: BLE001
            self.fail(s, e)


def _read(inbox: queue.Queue) -> None:
    for raw in sys.stdin:
        try:
            inbox.put(json.loads(raw))
        except json.JSONDecodeError:
            continue
    inbox.put(None)


def main() -> None:
    # Signals meant for the job (Ctrl-C, SLURM's SIGTERM) must not cut the flush short: the agent ends when
    # its input does, i.e. when the training process has finished or died.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(inbox,), daemon=True).start()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import_error = None
    try:
        from pipeline.tracking import store  # noqa: F401  (mlflow: the slow part, while the reader buffers)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        import_error = f"{type(e).__name__}: {e}"
    for name in ("alembic", "mlflow", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    Agent(out, import_error).loop(inbox)


if __name__ == "__main__":
    main()
