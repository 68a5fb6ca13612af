"""The job's side of the tracking agent (imports nothing heavy): find the agent for a tracking URI, or start it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import queue
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import DEVNULL, Popen

from pipeline.files.limits import MAX_EVENT

# Without clients this long, the agent exits: long enough for the next run of a working session.
IDLE_SECONDS = float(os.environ.get("PIPELINE_TRACKING_AGENT_IDLE", "300"))
SPAWN_WAIT = 60.0  # seconds for a new agent to bind its socket (it does so before importing mlflow)
MAX_METRICS_LINES = 1000  # metrics.jsonl lines in one message (the agent reads at most MAX_REQUEST)
log = logging.getLogger("pipeline")


# The socket and the log live in a directory only this user can enter: another user's process can neither
# listen where a job connects (and read its events, or answer with a forged run URI) nor plant a link where
# the agent's log is opened. Both ends check the other's uid as well (SO_PEERCRED).
def private_problem(directory: Path) -> str | None:
    """Why `directory` is not this user's alone (None if it is): a real directory, this user's, mode 0700."""
    try:
        st = os.lstat(directory)
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if (mode := stat.S_IMODE(st.st_mode)) & 0o077:
        return f"has mode {mode:04o}, which lets other users in (it must be 0700)"
    return None


def private_dir(directory: Path) -> Path:
    """`directory`, made (0700) if missing, once checked to be this user's alone: else OSError naming it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    if (problem := private_problem(directory)) is not None:
        raise OSError(f"the tracking agent's directory {directory} {problem}: not used")
    return directory


def socket_path(uri: str) -> Path:
    """Short and per user: in $XDG_RUNTIME_DIR if it is this user's alone, else in `<temp dir>/pipeline-<uid>`."""
    xdg = os.environ.get("XDG_RUNTIME_DIR") or ""
    private = os.path.isabs(xdg) and private_problem(Path(xdg)) is None
    directory = Path(xdg) if private else Path(tempfile.gettempdir()) / f"pipeline-{os.getuid()}"
    return directory / f"pipeline-mlflow-{hashlib.sha256(uri.encode()).hexdigest()[:16]}.sock"


# An agent's files (socket, lock, log) live as long as it does: each URI ever tracked would leave its own.
def spawn_lock(path: Path) -> int:
    """An fd holding the flock of the lock file beside the socket `path` now (one removed meanwhile: taken again)."""
    lock = f"{path}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False)):
                return fd
        os.close(fd)


def remove_agent_files(path: Path) -> bool:
    """A gone agent's lock and log removed, under the lock, unless another agent serves `path` now; whether they are."""
    fd = spawn_lock(path)
    try:
        if os.path.lexists(path):
            return False
        path.with_suffix(".log").unlink(missing_ok=True)
        Path(f"{path}.lock").unlink()
        return True
    finally:
        os.close(fd)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (Linux's SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))


def json_lines(sock: socket.socket, limit: int):
    """Each JSON object on `sock`, a line of at most `limit` bytes each (else ValueError); other lines are skipped."""
    lines = sock.makefile("rb")
    while raw := read_line(lines, limit):
        try:
            message = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(message, dict):
            yield message


def read_line(f, limit: int) -> bytes:
    """One line of at most `limit` bytes (b"" at the end); ValueError for a longer one."""
    raw = f.readline(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"a line longer than {limit} bytes")
    return raw


class Link:
    """A writer thread finds or starts the agent and writes what is queued; a reader hands each event to its session."""

    def __init__(self, uri: str):
        self.path = socket_path(uri)
        self.queue: queue.Queue = queue.Queue()
        self.handlers: dict = {}  # sid -> what has on_event(event): the agent's events for its session
        self.ids = itertools.count(1)
        self.dead: str | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._write, daemon=True, name="tracking_write").start()

    def register(self, handler) -> int:
        with self.lock:
            sid = next(self.ids)
            if self.dead is None:
                self.handlers[sid] = handler
        if self.dead is not None:  # it died before this session began: say so now, not never
            handler.on_event({"event": "error", "message": self.dead})
        return sid

    def send(self, msg: dict) -> None:
        self.queue.put(msg)

    def drain(self, timeout: float) -> bool:
        """Wait at most `timeout` s until everything sent so far is written to the agent's socket."""
        written = threading.Event()
        self.queue.put(written)
        return written.wait(max(0.0, timeout))

    def _write(self) -> None:
        try:
            sock = connect_or_spawn(self.path)
        except OSError as e:
            self._died(str(e))
            return
        threading.Thread(target=self._read, args=(sock,), daemon=True, name="tracking_read").start()
        wfile = sock.makefile("wb")
        try:
            while True:
                batch = [self.queue.get()]
                with contextlib.suppress(queue.Empty):
                    while True:
                        batch.append(self.queue.get_nowait())
                out: list[dict] = []
                marks = [m for m in batch if isinstance(m, threading.Event)]
                for msg in (m for m in batch if not isinstance(m, threading.Event)):
                    last = out[-1] if out else {}
                    same = msg["op"] == last.get("op") == "metrics" and last["sid"] == msg["sid"]
                    if same and len(last["lines"]) < MAX_METRICS_LINES:
                        last["lines"] = last["lines"] + msg["lines"]  # consecutive lines together
                    else:
                        out.append(msg)
                for msg in out:
                    wfile.write(f"{json.dumps(msg, allow_nan=False)}\n".encode())
                wfile.flush()
                for mark in marks:
                    mark.set()
        except (OSError, ValueError) as e:
            self._died(f"the tracking agent stopped reading ({e})")

    def _read(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for event in json_lines(sock, MAX_EVENT):
                if (handler := self.handlers.get(event.get("sid"))) is None:
                    continue
                handler.on_event(event)
                if event.get("event") in ("finished", "error"):
                    with self.lock:
                        self.handlers.pop(event["sid"], None)
        self._died("the tracking agent closed the connection")

    def _died(self, reason: str) -> None:
        self.dead = self.dead or reason
        with self.lock:
            orphans, self.handlers = list(self.handlers.values()), {}
        for handler in orphans:
            handler.on_event({"event": "error", "message": self.dead})


class Request:
    """One session's answer: the first event of `kinds` (`done` set), each event heard by `heard` first."""

    def __init__(self, kinds=("ready", "finished", "error", "pong"), heard=None):
        self.kinds, self.done, self.heard = kinds, threading.Event(), heard
        self.event: dict | None = None

    def on_event(self, event: dict) -> None:
        if self.heard is not None:
            self.heard(event)
        if event.get("event") in self.kinds:
            self.event = event
            self.done.set()


def request(link, op: str, handler=None, **fields):
    """Send `op` through `link` as a session of its own, answered to `handler` (a new Request if none), returned."""
    handler = handler or Request()
    link.send({"op": op, "sid": link.register(handler), **fields})
    return handler


def _connect(path: Path) -> socket.socket | None:
    """A socket connected to the agent at `path`; None if none listens; OSError if it runs as another user (unsent)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10.0)
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    try:
        pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            said = f"the process listening on {path} (pid {pid}) runs as uid {uid}, not as"
            raise OSError(f"{said} this user (uid {os.getuid()}): refused, nothing sent to it")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def spawn(path: Path) -> Popen:
    """Start an agent serving `path` in its own session, logging beside it (.log) if that opens safely, else nowhere."""
    log_file = path.with_suffix(".log")
    root = str(Path(__file__).resolve().parents[2])  # the directory holding this `pipeline`, first
    path_env = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path_env}
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd: int | None = None
    try:
        fd = os.open(log_file, flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: never written to, waited on
            raise OSError(errno.EINVAL, "it is not a regular file")
        os.set_blocking(fd, True)
    except OSError as e:
        why = "it is a symlink, not followed" if e.errno == errno.ELOOP else (e.strerror or str(e))
        said = "the tracking agent's log %s cannot be opened (%s): the agent logs nowhere"
        log.warning(said, log_file, why)
        if fd is not None:
            os.close(fd)
        fd = None
    out = DEVNULL if fd is None else fd
    argv = [sys.executable, "-m", "pipeline.tracking.agent", "--listen", str(path)]
    argv += ["--idle", str(IDLE_SECONDS)]
    try:  # no other file descriptor is passed on (close_fds: Popen's default)
        return Popen(argv, stdin=DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True)
    finally:
        if fd is not None:
            os.close(fd)


_LINKS: dict[str, Link] = {}
_LINKS_LOCK = threading.Lock()


def connect_or_spawn(path: Path) -> socket.socket:
    """A socket connected to the agent at `path`, spawned under the lock if none runs; OSError if none can be."""
    private_dir(path.parent)
    if (sock := _connect(path)) is not None:
        return sock
    fd = spawn_lock(path)
    try:
        if (sock := _connect(path)) is not None:
            return sock
        path.unlink(missing_ok=True)  # a stale socket of an agent that died
        proc, deadline = spawn(path), time.monotonic() + SPAWN_WAIT
        while sock is None and time.monotonic() < deadline:
            if proc.poll() is not None:
                why = f"the tracking agent exited at start (code {proc.returncode}); see {path.with_suffix('.log')}"
                raise OSError(errno.ECHILD, why)
            time.sleep(0.01)
            sock = _connect(path) if path.exists() else None
        if sock is None:
            why = f"the tracking agent did not start within {SPAWN_WAIT:.0f} s"
            raise OSError(errno.ETIMEDOUT, why)
        return sock
    finally:
        os.close(fd)


def agent_for(uri: str) -> Link:
    """This process's link to the agent for `uri`, at once (found or started in the background; else sessions err)."""
    with _LINKS_LOCK:
        link = _LINKS.get(uri)
        if link is None or link.dead is not None:
            link = _LINKS[uri] = Link(uri)
        return link


def wait_idle(uri: str, timeout: float = 600.0) -> bool:
    """Wait until the agent for `uri` has nothing left to do; True if none runs (never starts one). Tests, benches."""
    path = socket_path(uri)
    if private_problem(path.parent) is not None:
        return True  # no agent of this user's is started there
    try:
        sock = _connect(path) if path.exists() else None
    except OSError:
        return False  # another user's process: never asked
    if sock is None:
        return True
    try:
        sock.settimeout(timeout)
        sock.sendall((json.dumps({"op": "idle", "sid": 1, "uri": uri}) + "\n").encode())
        line = read_line(sock.makefile("rb"), MAX_EVENT)
        return bool(line) and json.loads(line).get("event") == "idle"
    except (OSError, ValueError):
        return False
    finally:
        sock.close()
