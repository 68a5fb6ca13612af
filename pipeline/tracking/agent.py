"""`python -m pipeline.tracking.agent --listen SOCKET`: the process that talks to mlflow for a machine's jobs."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.config.errors import EXIT_ERROR, CommandError
from pipeline.files.limits import MAX_LOCK, MAX_REQUEST
from pipeline.run.signals import SIGNALS, run_command
from pipeline.tracking.link import json_lines, peer_credentials, private_dir, remove_agent_files

MAX_PENDING = 1000  # metric points: one log_batch
FLUSH_EVERY = 1.0  # seconds: each log_batch is a sqlite commit (an fsync); batching spares the disk
GONE_WAIT = 120.0  # seconds a finished run waits for its job to leave before it is indexed anyway
TRACE = bool(os.environ.get("PIPELINE_TRACKING_AGENT_TRACE"))  # each request's time, in its log
T0 = time.monotonic()
EOF = object()
# Why a process, not a thread: `import mlflow` (~3 s) and opening a store (1-3 s) hold the GIL and would stall
# training. The Agent imports them once main has bound the socket, so a job connects at once.


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def trace(what: str, started: float) -> None:
    if TRACE:
        now = time.monotonic()
        say(f"[agent +{now - T0:7.3f} s] {what}: {now - started:.3f} s")


class Conn:
    def __init__(self, cid: int, sock: socket.socket):
        self.cid, self.out, self.closed = cid, sock.makefile("wb"), False

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
        self.client: Any = None  # its store's MlflowClient, once opened (mlflow is imported lazily)
        self.uri, self.repo = "", None  # its store, and its run's artifacts once open
        self.run_id: str | None = None
        self.parent: dict | None = None
        self.logged: set = set()  # (key, step) already in mlflow (a resumed run): not logged again
        self.pending: list = []
        self.failed = False

    def send(self, event: str, **fields) -> None:
        self.conn.send({"sid": self.sid, "event": event, **fields})


# JSON lines; each request names a session `sid` unique on its connection; events out: {"sid", "event", ...}.
#   open {uri, artifact_location, experiment, run_dir, params, tags, start_time, previous_run_uri, parent} -> ready
#   metrics {lines}; checkpoint {artifact, manifest}: into the open session's run
#   finish {run_dir, job, pid}: flush; index the run directory once the job has gone            -> finished
#   attach {uri, artifact_location, run_dir, parent, job}: a run done before                     -> finished
#   parent_start {uri, artifact_location, sweep_id, sweep_dir} -> ready; sweep_end {uri, sweep_dir, parent} -> finished
#   ping {uri}: open the store now -> pong; idle: answered once nothing else is connected or open (tests, benches)
# pong and open's ready carry the store's "warning" (a sqlite store shared beyond one host), if it has one.
# A failing mlflow call reports one error for its session, which is dropped; a connection that closes with a run
# open (its process died) has it flushed and ended FAILED; without clients and work for --idle s, the agent exits.
class Agent:
    def __init__(self):
        self.import_error = None
        started = time.monotonic()
        try:
            # All the agent runs, now (mlflow: the slow part, while the readers buffer): a module imported later,
            # from a checkout changed meanwhile, would not match those loaded (an ImportError left parents RUNNING).
            from pipeline.tracking import common, index, store

            self.common, self.index, self.store = common, index, store
            trace("import mlflow", started)
        except BaseException as e:
            traceback.print_exc()
            self.import_error = f"{type(e).__name__}: {e}"
        self.sessions: dict[tuple[int, Any], Session] = {}  # (connection, the request's sid)
        self.clients: dict[str, Opened] = {}  # uri -> its store, open
        self.parents: dict[tuple[str, str], dict] = {}  # (uri, sweep id) -> its parent run
        self.finishing: list[tuple[Session, dict, float]] = []  # handed over, done once it left
        self.waiters: list[tuple[Conn, object]] = []  # idle requests

    def parent_of(self, uri: str, ref: dict | None) -> dict | None:
        """A job's parent run, named by its sweep's id ({"sweep_id"}: the launcher does not wait for the run)."""
        if not isinstance(sweep_id := (ref or {}).get("sweep_id"), str):
            return None
        if (uri, sweep_id) not in self.parents:
            if (found := self.store.find_parent(self.opened(uri).client, sweep_id)) is None:
                return None
            self.parents[uri, sweep_id] = self.index.ids_of(found)
        return self.parents[uri, sweep_id]

    def fail(self, s: Session, e: BaseException | str) -> None:
        s.pending = []
        if not s.failed:
            s.failed = True
            first = str(e).strip().splitlines()[:1]
            msg = e if isinstance(e, str) else f"{type(e).__name__}: {''.join(first)}"
            if not isinstance(e, str) and type(e).__name__ != "StoreError":
                traceback.print_exception(e, file=sys.stderr)
            s.send("error", message=msg[:2000])

    def tried(self, s: Session, call, *args, **kwargs) -> Any:
        """call(*args, **kwargs); None once its exception is the session's one error."""
        try:
            return call(*args, **kwargs)
        except Exception as e:
            self.fail(s, e)
            return None

    def opened(self, uri: str, artifact_root: str | None = None) -> Opened:
        """The store at `uri`, opened once; anew once its sqlite file was removed or replaced (`rm -rf outputs`)."""
        if (have := self.clients.get(uri)) is not None and have.file != self.file_of(uri):
            why = f"tracking agent: the mlflow store {uri} was removed or replaced since it was opened"
            say(f"{why}: opened anew")
            self.store.forget_store(uri)
            self.parents = {k: v for k, v in self.parents.items() if k[0] != uri}  # the old store's
            del self.clients[uri]
        if uri not in self.clients:
            client, warning = self.store.open_store(uri, artifact_root)
            said = {"warning": warning} if warning else {}
            self.clients[uri] = Opened(client, artifact_root, self.file_of(uri), said)
        return self.clients[uri]

    def file_of(self, uri: str) -> tuple[int, int] | None:
        """(device, inode) of a sqlite store's file, None if it has none (yet) or the store is not a sqlite file."""
        with contextlib.suppress(OSError):
            if (db := self.common.sqlite_path(uri)) is not None:
                return (st := os.stat(db)).st_dev, st.st_ino
        return None

    def open(self, s: Session, m: dict) -> None:
        s.uri = uri = m["uri"]
        s.client = client = self.opened(uri, m.get("artifact_location")).client
        parent = s.parent = self.parent_of(uri, m.get("parent"))
        previous = m.get("previous_run_uri")
        tags, params, started = m["tags"], m["params"], m.get("start_time")
        experiment = (m["experiment"], m.get("artifact_location"))
        run = self.store.find_run(client, tags["run_dir"], uri, [previous])
        made = {"continued_from": previous} if previous else None  # a fork, or another store's run
        run, _ = self.index.open_run(client, run, tags, params, parent, started, experiment, made)
        s.run_id, ids = run.info.run_id, self.index.ids_of(run)
        s.logged = self.store.logged_steps(client, s.run_id, run.data.metrics.keys())
        if run.info.status != "RUNNING":
            client.update_run(s.run_id, status="RUNNING")
        s.repo = self.store.artifact_repo(client, s.run_id)
        s.send("ready", **ids, uri=self.run_uri(uri, ids), **self.clients[uri].said)

    def run_uri(self, uri: str, ids: dict) -> str:
        return self.common.run_uri(uri, ids["experiment_id"], ids["run_id"])

    def metrics(self, s: Session, m: dict) -> None:
        points = [p for line in m["lines"] for p in self.common.metric_points(line)]
        s.pending += [p for p in points if (p[0], p[3]) not in s.logged]  # (key, step) mlflow lacks
        if len(s.pending) >= MAX_PENDING:
            self.flush(s)

    def flush(self, s: Session) -> None:
        if s.pending and not s.failed and s.run_id:
            points, s.pending = s.pending, []
            self.store.log_points(s.client, s.run_id, points)
            s.logged.update((p[0], p[3]) for p in points)

    def checkpoint(self, s: Session, m: dict) -> None:
        self.store.log_file_as(s.repo, m["artifact"], m["manifest"].encode())

    def finish(self, s: Session, m: dict) -> None:
        """The job hands its run over and leaves: its points now, the run directory once it has gone."""
        self.flush(s)
        self.finishing.append((s, m, time.monotonic() + GONE_WAIT))

    def finish_gone(self, complete: Path | None = None) -> None:
        """Complete each handed-over run whose job left, or whose run directory is `complete`: status, artifacts."""
        waiting, done = [], []
        for s, m, deadline in self.finishing:
            run_dir = Path(m["run_dir"])
            busy = run_dir.resolve() != complete and _held_by(run_dir, m.get("pid"))
            if busy and time.monotonic() < deadline:
                waiting.append((s, m, deadline))
                continue
            started, root = time.monotonic(), self.clients[s.uri].artifact_root
            args = (s.client, s.uri, run_dir, root, s.parent, m.get("job"))
            if (r := self.tried(s, self.index.sync_run, *args, artifacts=False)) is not None:
                done.append((s, run_dir, r))
            trace("finish: the run complete", started)
        self.finishing = waiting
        for s, run_dir, r in done:
            started = time.monotonic()
            if "run_id" in r:
                if self.tried(s, self.index.sync_artifacts, s.client, r["run_id"], run_dir) is None:
                    continue
                trace("finish: its artifacts", started)
            s.send("finished")

    def attach(self, s: Session, m: dict) -> None:
        """A job whose run directory was complete before it started: indexed (its run made if the store lacks it)."""
        run_dir, uri, where = Path(m["run_dir"]), m["uri"], m.get("artifact_location")
        if self.finishing:  # the run this repeats, handed over by an earlier job of the same process: complete first
            self.finish_gone(complete=run_dir.resolve())
        client = self.opened(uri, where).client  # first: with its artifact root
        parent, job = self.parent_of(uri, m.get("parent")), m.get("job") or {}
        r = self.index.sync_run(client, uri, run_dir, where, parent, job, repeat=True)
        s.send("finished", uri=self.run_uri(uri, r) if "run_id" in r else None)

    def parent_start(self, s: Session, m: dict) -> None:
        """The sweep's parent, made from its sweep.json by the code reindex uses (pipeline/tracking/index.py)."""
        where = m.get("artifact_location")
        client = self.opened(m["uri"], where).client
        run, created = self.index.open_parent(client, Path(m["sweep_dir"]), where)
        if not created:  # the same sweep again: its parent goes on
            client.update_run(run.info.run_id, status="RUNNING")
        ids = self.parents[m["uri"], m["sweep_id"]] = self.index.ids_of(run)
        s.send("ready", uri=self.run_uri(m["uri"], ids), **ids)

    def sweep_end(self, s: Session, m: dict) -> None:
        uri, client = m["uri"], self.opened(m["uri"]).client
        parent, root = self.parent_of(uri, m["parent"]), self.clients[uri].artifact_root
        r = self.index.sync_parent(client, uri, Path(m["sweep_dir"]), root, parent, children=False)
        s.send("finished", status=r["status"], children=r["children"], uri=self.run_uri(uri, r))

    def ping(self, s: Session, m: dict) -> None:
        s.send("pong", **self.opened(m["uri"], m.get("artifact_location")).said)

    OPENING = ("open", "attach", "parent_start", "sweep_end", "ping")

    def handle(self, conn: Conn, m: dict) -> None:
        key, op = (conn.cid, m.get("sid")), str(m.get("op"))
        if op == "idle":
            self.waiters.append((conn, m.get("sid")))
            return
        s = Session(conn, m["sid"]) if op in self.OPENING else self.sessions.get(key)
        if s is None or s.failed:  # a session failed, or never opened
            if op == "finish":
                conn.send({"sid": m.get("sid"), "event": "finished"})
            return
        if op in self.OPENING:
            if self.import_error:
                self.fail(s, f"mlflow could not be imported: {self.import_error}")
                return
            self.sessions[key] = s
        started = time.monotonic()
        self.tried(s, lambda: getattr(self, op)(s, m))  # an unknown op too: the session's error
        trace(op, started)
        if op not in ("open", "metrics", "checkpoint"):
            self.sessions.pop(key, None)

    def close_conn(self, conn: Conn) -> None:
        """The client's process went away without finishing its runs: keep what was sent, end them FAILED."""
        for key in [k for k in self.sessions if k[0] == conn.cid]:
            s = self.sessions.pop(key)
            if s.failed or s.run_id is None:
                continue
            try:
                self.flush(s)
                why = "the training process exited without finishing the run"
                s.client.set_tag(s.run_id, "ended", why)
                s.client.set_terminated(s.run_id, status="FAILED", end_time=int(time.time() * 1000))
            except Exception as e:
                traceback.print_exception(e, file=sys.stderr)

    def answer_idle(self, clients: set) -> None:
        """Answer the idle requests once nothing but their own connections is left."""
        waiting = {conn.cid for conn, _ in self.waiters}
        if self.waiters and not self.sessions and not self.finishing and not (clients - waiting):
            for conn, sid in self.waiters:
                conn.send({"sid": sid, "event": "idle"})
            self.waiters = []

    def loop(self, inbox: queue.Queue, clients: set, idle: float) -> None:
        last_flush, last_busy = time.monotonic(), time.monotonic()
        while True:
            pending = any(s.pending for s in self.sessions.values())
            timeout = max(0.0, last_flush + FLUSH_EVERY - time.monotonic()) if pending else 1.0
            if self.finishing or self.waiters:
                timeout = min(timeout, 0.05)  # a job leaves within moments of handing over
            batch = []
            with contextlib.suppress(queue.Empty):
                batch.append(inbox.get(timeout=timeout))
                while len(batch) < 5000:
                    batch.append(inbox.get_nowait())
            for conn, m in batch:
                if m is EOF:
                    self.close_conn(conn)
                    clients.discard(conn.cid)
                    self.waiters = [w for w in self.waiters if w[0] is not conn]
                else:
                    self.handle(conn, m)
            self.finish_gone()
            if time.monotonic() - last_flush >= FLUSH_EVERY:  # metrics go in batches, once a second
                for s in list(self.sessions.values()):
                    self.tried(s, self.flush, s)
                last_flush = time.monotonic()
            self.answer_idle(clients)
            if clients or self.sessions or self.finishing or batch:
                last_busy = time.monotonic()
            elif time.monotonic() - last_busy > idle:
                return


class Opened(NamedTuple):
    client: Any  # its MlflowClient
    artifact_root: str | None
    file: tuple[int, int] | None  # a sqlite store's file as opened (device, inode); else None
    said: dict  # {"warning": store.check_shared's}, or {}: said to each job that uses the store


def _held_by(run_dir: Path, pid: int | None) -> bool:
    """Whether the process `pid` still holds the run directory's lock (a job that has not left yet)."""
    from pipeline.files import reading
    from pipeline.run.directory import RunDir

    rundir = RunDir(run_dir)
    if not rundir.in_use():
        return False
    try:  # no link, FIFO
        holder = reading.read_bytes(rundir.lock_path, MAX_LOCK).decode(errors="replace").strip()
    except OSError:
        return False
    return holder in ("", str(pid))  # "": a new holder not yet claimed, or the job before its claim


def _read(conn: Conn, sock: socket.socket, inbox: queue.Queue) -> None:
    try:
        for message in json_lines(sock, MAX_REQUEST):
            inbox.put((conn, message))
    except ValueError as e:
        say(f"tracking agent: connection {conn.cid} closed: {e}")
    except OSError:
        pass
    inbox.put((conn, EOF))


def _accept(server: socket.socket, inbox: queue.Queue, clients: set) -> None:
    """Serve each client of this user's (SO_PEERCRED); another user's connection is closed unread."""
    cid = 1
    while True:
        try:
            sock, _ = server.accept()
        except OSError:
            return
        pid = uid = None
        with contextlib.suppress(OSError):
            pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            said = f"tracking agent: refused a client (pid {pid}, uid {uid}): it does not run as"
            say(f"{said} this agent's user (uid {os.getuid()})")
            sock.close()
            continue
        conn = Conn(cid, sock)
        clients.add(cid)
        threading.Thread(target=_read, args=(conn, sock, inbox), daemon=True).start()
        cid += 1


def main(argv: list[str] | None = None) -> None:
    """The agent's life; run_command (below) turns a refusal into its one line and exit code."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True, help="the Unix socket to serve")
    parser.add_argument("--idle", type=float, default=300.0, help="exit after this long idle (s)")
    args = parser.parse_args(argv)
    # Signals meant for jobs (Ctrl-C, SLURM's SIGTERM) must not cut a flush short: the agent ends when idle.
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:  # the job checked it; so does the agent, before it binds there
        private_dir(Path(args.listen).parent)
    except OSError as e:
        raise CommandError(e.strerror or str(e), exit_code=EXIT_ERROR) from None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{args.listen}.{os.getpid()}"
    server.bind(tmp)
    server.listen(128)
    os.rename(tmp, args.listen)  # the socket appears bound and listening, never half-made
    inbox: queue.Queue = queue.Queue()
    clients: set = set()
    threading.Thread(target=_accept, args=(server, inbox, clients), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    time.sleep(float(os.environ.get("PIPELINE_TRACKING_AGENT_DELAY", "0") or 0))  # a test: slow
    agent = Agent()
    for name in ("alembic", "mlflow", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        agent.loop(inbox, clients, args.idle)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(args.listen)  # no longer findable: a new client starts a new agent ...
        server.close()
    agent.loop(inbox, clients, 0.0)  # ... and whoever connected meanwhile is served until it leaves
    with contextlib.suppress(OSError):
        remove_agent_files(Path(args.listen))


if __name__ == "__main__":
    run_command("tracking agent", main)
