"""`python -m pipeline.tracking.agent [--listen SOCKET]`: the helper process that talks to mlflow.

Why a process and not a thread: `import mlflow` (~3.5 s) and opening a sqlite store (1-3 s) are Python work
that holds the GIL; in a thread of the training process they stalled a 1.5 s training run to 5.7 s. Here they
run on another core while training goes on, and the training process only ever enqueues.

Who starts one: a single run's tracker (talking over the agent's stdin/stdout, kept for the next jobs of that
process); and for a multirun the sweep callback, with `--listen`: the jobs of the sweep (basic launcher,
joblib workers, submitit_local jobs) connect to its Unix socket instead of each importing mlflow, so a sweep
imports mlflow once and every write to the store goes through one process (no schema race, no lock
contention). A job that cannot reach the socket (SLURM on another node) starts its own agent.

Protocol: JSON lines. In, each with a request id `sid` unique on its connection:
  {"op": "open", "sid", "uri", "artifact_location", "experiment", "run_dir", "params", "tags",
   "previous_run_uri", "resume_step", "parent": {"uri", "experiment_id", "run_id"} | null}
  {"op": "metrics", "sid", "lines": [metrics.jsonl lines]}
  {"op": "checkpoint", "sid", "step", "manifest": "<manifest.json text>"}
  {"op": "finish", "sid", "status", "run_dir"}
  {"op": "parent_start", "sid", "uri", "experiment", "artifact_location", "tags"}     (the sweep callback)
  {"op": "parent_end", "sid", "parent", "interrupted": null | "why"}
  {"op": "failed_child", "sid", "parent", "run_dir", "params", "tags"}
Out: {"sid", "event": "ready", "uri", "run_id", "experiment_id"} | {"sid", "event": "error", "message"}
| {"sid", "event": "finished", ...}. A connection that closes with runs still open (its process died) has
them flushed and ended FAILED; the end of stdin ends the agent. A failing mlflow call reports one error for
its session, which is dropped; other sessions go on.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

MAX_PENDING = 1000  # metric points: one log_batch
FLUSH_EVERY = 1.0  # seconds: each log_batch is a sqlite commit (an fsync); batching spares the disk
EOF = object()


class Conn:
    """One client: the stdin/stdout pair, or an accepted socket."""

    def __init__(self, cid: int, out):
        self.cid, self.out = cid, out
        self.closed = False

    def send(self, event: dict) -> None:
        if self.closed:
            return
        try:
            self.out.write((json.dumps(event) + "\n").encode())
            self.out.flush()
        except (OSError, ValueError):
            self.closed = True  # the client went away; its EOF arrives through the inbox


class Session:
    def __init__(self, conn: Conn, sid: int):
        self.conn, self.sid = conn, sid
        self.client = None
        self.run_id: str | None = None
        self.repo = None  # the run's artifact repository
        self.logged: set = set()  # (key, step) already in mlflow (a resumed run): not logged again
        self.pending: list = []
        self.failed = False


class Agent:
    def __init__(self, import_error: str | None):
        self.import_error = import_error
        self.sessions: dict[tuple[int, int], Session] = {}
        self.clients: dict[str, object] = {}

    def fail(self, s: Session, e: BaseException | str) -> None:
        s.pending = []
        if not s.failed:
            s.failed = True
            msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}".strip()
            if not isinstance(e, str):
                traceback.print_exception(e, file=sys.stderr)
            s.conn.send({"sid": s.sid, "event": "error", "message": msg[:2000]})

    def client(self, uri: str):
        from pipeline.tracking import store

        if uri not in self.clients:
            self.clients[uri] = store.open_client(uri)
        return self.clients[uri]

    # --- a job's run
    def open(self, s: Session, m: dict) -> None:
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
        s.repo = store.artifact_repo(client, s.run_id)
        s.conn.send({"sid": s.sid, "event": "ready", "uri": run_uri(uri, run.info.experiment_id, s.run_id),
                     "run_id": s.run_id, "experiment_id": run.info.experiment_id})

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

        store.log_file_as(s.repo, f"checkpoints/step-{int(m['step']):08d}/manifest.json", data=m["manifest"].encode())

    def finish(self, s: Session, m: dict) -> None:
        from pipeline.tracking import store
        from pipeline.tracking.common import FINAL_MANIFEST_ARTIFACT, FINAL_WEIGHTS_ARTIFACT

        self.flush(s)
        run_dir = Path(m["run_dir"])
        from pipeline.rundir import RunDir

        store.log_curves(s.repo, RunDir(run_dir).read_metrics())
        from pipeline.rundir import RunDir

        final = RunDir(run_dir).store.link_dir("final")
        if m["status"] == "FINISHED" and final is not None:
            store.log_file_as(s.repo, FINAL_WEIGHTS_ARTIFACT, source=final / "weights.safetensors")
            store.log_file_as(s.repo, FINAL_MANIFEST_ARTIFACT, source=final / "manifest.json")
        s.client.set_terminated(s.run_id, status=m["status"], end_time=int(time.time() * 1000))
        s.conn.send({"sid": s.sid, "event": "finished"})

    # --- the sweep's parent run (requests from the sweep callback, answered at once)
    def parent_start(self, s: Session, m: dict) -> None:
        from pipeline.tracking import store
        from pipeline.tracking.common import run_uri

        client = self.client(m["uri"])  # a fresh sqlite DB is created and migrated here, once
        experiment_id = store.ensure_experiment(client, m["experiment"], m.get("artifact_location"))
        run = store.create_run(client, experiment_id, m["tags"])
        s.conn.send({"sid": s.sid, "event": "ready", "uri": run_uri(m["uri"], experiment_id, run.info.run_id),
                     "run_id": run.info.run_id, "experiment_id": experiment_id})

    def parent_end(self, s: Session, m: dict) -> None:
        parent = m["parent"]
        client = self.client(parent["uri"])
        children = client.search_runs([parent["experiment_id"]], f"tags.mlflow.parentRunId = '{parent['run_id']}'",
                                      max_results=10000)
        statuses = [c.info.status for c in children]
        if "FAILED" in statuses:
            status = "FAILED"
        elif m.get("interrupted"):
            status = "KILLED" if "KILLED" in statuses else "FAILED"
        else:
            status = "KILLED" if "KILLED" in statuses else "FINISHED"
        vals = [c.data.metrics["val/loss"] for c in children if "val/loss" in c.data.metrics]
        if vals:
            client.log_metric(parent["run_id"], "best/val/loss", min(vals))
        client.set_tag(parent["run_id"], "sweep.children", str(len(children)))
        if m.get("interrupted"):
            client.set_tag(parent["run_id"], "ended", m["interrupted"])
        client.set_terminated(parent["run_id"], status=status, end_time=int(time.time() * 1000))
        s.conn.send({"sid": s.sid, "event": "finished", "status": status, "children": len(children)})

    def failed_child(self, s: Session, m: dict) -> None:
        """A child for a job that failed before its tracker started, ended FAILED (the same run if it exists)."""
        from pipeline.tracking import store

        parent = m["parent"]
        client = self.client(parent["uri"])
        run = store.find_run(client, m["run_dir"]) if m.get("run_dir") else None
        if run is None:
            run = store.create_run(client, parent["experiment_id"], m["tags"])
        else:
            store.sync_tags(client, run, m["tags"])
        store.sync_params(client, run, m["params"])
        client.set_terminated(run.info.run_id, status="FAILED", end_time=int(time.time() * 1000))
        s.conn.send({"sid": s.sid, "event": "finished", "run_id": run.info.run_id})

    # --- dispatch
    def handle(self, conn: Conn, m: dict) -> None:
        key = (conn.cid, m["sid"])
        op = m["op"]
        if op in ("open", "parent_start", "parent_end", "failed_child"):
            s = self.sessions[key] = Session(conn, m["sid"])
            if self.import_error:
                return self.fail(s, f"mlflow could not be imported: {self.import_error}")
        else:
            s = self.sessions.get(key)
            if s is None or s.failed:
                if op == "finish":
                    conn.send({"sid": m["sid"], "event": "finished"})
                return
        try:
            getattr(self, op)(s, m)
        except Exception as e:  # noqa: BLE001 - any tracking failure is reported, never raised
            self.fail(s, e)
        if op not in ("open", "metrics", "checkpoint"):
            self.sessions.pop(key, None)

    def close_conn(self, conn: Conn) -> None:
        """The client's process went away without finishing its runs: keep what was sent, end them FAILED."""
        for key, s in list(self.sessions.items()):
            if key[0] != conn.cid:
                continue
            del self.sessions[key]
            if s.failed or s.run_id is None:
                continue
            try:
                self.flush(s)
                s.client.set_tag(s.run_id, "ended", "the training process exited without finishing the run")
                s.client.set_terminated(s.run_id, status="FAILED", end_time=int(time.time() * 1000))
            except Exception as e:  # noqa: BLE001
                traceback.print_exception(e, file=sys.stderr)

    def _safe_flush(self, s: Session) -> None:
        try:
            self.flush(s)
        except Exception as e:  # noqa: BLE001
            self.fail(s, e)

    def loop(self, inbox: queue.Queue, main_conn: Conn) -> None:
        last_flush = time.monotonic()
        while True:
            pending = any(s.pending for s in self.sessions.values())
            timeout = max(0.0, last_flush + FLUSH_EVERY - time.monotonic()) if pending else None
            try:
                batch = [inbox.get(timeout=timeout)]
            except queue.Empty:
                batch = []
            while len(batch) < 5000:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for conn, m in batch:
                if m is EOF:
                    self.close_conn(conn)
                    if conn is main_conn:  # the process that started the agent is done: so is the agent
                        for other in {s.conn for s in self.sessions.values()}:
                            self.close_conn(other)
                        return
                else:
                    self.handle(conn, m)
            if time.monotonic() - last_flush >= FLUSH_EVERY:  # metrics go in batches, at most once a second
                for s in list(self.sessions.values()):
                    self._safe_flush(s)
                last_flush = time.monotonic()


def _read(conn: Conn, rfile, inbox: queue.Queue) -> None:
    try:
        for raw in rfile:
            try:
                inbox.put((conn, json.loads(raw)))
            except json.JSONDecodeError:
                continue
    except OSError:
        pass
    inbox.put((conn, EOF))


def _accept(server: socket.socket, inbox: queue.Queue) -> None:
    cid = 1
    while True:
        try:
            sock, _ = server.accept()
        except OSError:
            return
        conn = Conn(cid, sock.makefile("wb"))
        threading.Thread(target=_read, args=(conn, sock.makefile("rb"), inbox), daemon=True).start()
        cid += 1


def _yield_to_training(priority: str) -> None:
    """Run below the training processes (tracking.priority). The agent's CPU is mostly importing mlflow
    (~3.5 s); at normal priority, with numpy's threads on every core, it slowed a 15 s training run by ~17%.
    - "10" (the default; any nice value): a tenth of a busy core's share -- most of the agent's work goes to
      cycles training leaves idle, and it still progresses on a machine loaded by other processes.
    - "idle" (SCHED_IDLE): only cycles nobody else wants: training is not slowed at all (+0-3% measured), the
      mlflow work happens when training blocks (at the latest when the last checkpoint waits for the run's
      URI). On a machine saturated by other processes it can starve, and the run's end then waits up to
      30 s + tracking.flush_timeout before warning and leaving the agent to finish in the background.
    - "normal": no change."""
    try:
        if priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif priority != "normal":
            os.nice(int(priority))
    except (AttributeError, OSError, ValueError):
        try:
            os.nice(10)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", default=None, help="also serve jobs on this Unix socket")
    parser.add_argument("--priority", default="10", help="idle (SCHED_IDLE), a nice value, or normal")
    args = parser.parse_args(argv)
    # Signals meant for the job (Ctrl-C, SLURM's SIGTERM) must not cut the flush short: the agent ends when
    # its input does, i.e. when the process that started it has finished or died.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _yield_to_training(args.priority)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    inbox: queue.Queue = queue.Queue()
    main_conn = Conn(0, out)
    threading.Thread(target=_read, args=(main_conn, sys.stdin.buffer, inbox), daemon=True).start()
    server = None
    if args.listen:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(args.listen)
        server.listen(64)
        threading.Thread(target=_accept, args=(server, inbox), daemon=True).start()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import_error = None
    try:
        from pipeline.tracking import store  # noqa: F401  (mlflow: the slow part, while the readers buffer)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        import_error = f"{type(e).__name__}: {e}"
    for name in ("alembic", "mlflow", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        Agent(import_error).loop(inbox, main_conn)
    finally:
        if server is not None:
            server.close()
            try:
                os.unlink(args.listen)
                os.rmdir(os.path.dirname(args.listen))
            except OSError:
                pass


if __name__ == "__main__":
    main()
