"""The tracking agent's rendezvous is private: its socket and log live in a directory only the user can enter,
checked before each use; the job talks only to an agent of its own uid and the agent serves only clients of its
own uid (SO_PEERCRED); the log is never opened through a link.

A refused directory is what an unreachable agent is: one warning, training goes on, not a byte sent. The
tests of a second user run as root: a forked child drops to `nobody` (uid 65534) and plays the other user."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import KERNODECK, env_for_subprocess, run_pipeline

from pipeline.tracking import agent, link, mlflow_tracker
from pipeline.tracking.link import wait_idle

NOBODY = 65534
WAIT = 120.0  # seconds: a generous bound on any wait here (a loaded machine is slow; none is ever reached)
as_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: a second user is played by a child that "
    "drops to uid 65534, and a directory is chowned to it",
)


@pytest.fixture
def base(monkeypatch):
    """A short temp dir (a Unix socket path must fit in ~100 bytes), world-writable, as the process's temp dir; no
    XDG_RUNTIME_DIR. Agents a test started there are ended by their pid afterwards. Without /tmp's sticky bit:
    fs.protected_symlinks, which would stop a root job following another user's link in a sticky directory, is
    no defence the pipeline counts on (a TMPDIR elsewhere, a user's job, a kernel setting)."""
    root = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    root.chmod(0o777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and b"pipeline.tracking.agent" in (cmd := (proc / "cmdline").read_bytes())
                and str(root).encode() in cmd
            ):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
    shutil.rmtree(root, ignore_errors=True)


def uri_in(root: Path) -> str:
    return f"sqlite:///{root}/out/mlflow.db"


def track(uri: str, run_dir: Path, caplog) -> list[logging.LogRecord]:
    """A job's tracker through prepare, start, a metric line, its run's URI and finish; its warnings."""
    caplog.set_level(logging.INFO, logger="pipeline")
    t = mlflow_tracker.MlflowTracker(uri=uri, experiment="e", artifact_location=None, wait=1.0)
    t.prepare()
    t.start(config={"name": "e"}, facts={}, run_dir=run_dir, previous_run_uri=None)
    assert t.done.wait(WAIT), "the tracker neither failed nor finished"  # set by its one failure
    t.log_line({"step": 1, "epoch": 0, "time": 0.0, "train/loss": 1.0})
    assert t.run_uri(timeout=1.0) is None
    t.finish("FINISHED", run_dir)
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def listener(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    server.setblocking(False)
    return server


def pending_connection(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


# --- (1) the directory: its mode, a link, its owner
def make_open_dir(d: Path) -> Path:
    d.mkdir(mode=0o700)
    d.chmod(0o755)
    return d


def make_link(d: Path) -> Path:
    real = d.with_name("elsewhere")
    real.mkdir(mode=0o700)
    d.symlink_to(real)
    return real


def make_foreign(d: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to uid 65534")
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    return d


@pytest.mark.parametrize(
    "make, problem",
    [
        (make_open_dir, "mode 0755"),
        (make_link, "is a symlink"),
        (make_foreign, f"owned by uid {NOBODY}"),
    ],
    ids=["mode-0755", "symlink", "other-owner"],
)
def test_a_directory_others_can_enter_is_refused_with_one_warning_and_no_connection(
    base, caplog, make, problem
):
    uri = uri_in(base)
    d = link.socket_path(uri).parent
    assert d != base and d.name == f"pipeline-{os.getuid()}"
    real = make(d)
    server = listener(
        real / link.socket_path(uri).name
    )  # an agent of this user's, there: never reached
    before = sorted(os.listdir(real))
    warnings = track(uri, base / "run", caplog)
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    assert str(d) in warnings[0].getMessage() and problem in warnings[0].getMessage()
    assert not pending_connection(server), "the job connected to a socket in a directory it refused"
    assert sorted(os.listdir(real)) == before  # no lock, no log, no socket made there


@pytest.mark.parametrize(
    "make, problem", [(make_open_dir, "mode 0755"), (make_link, "is a symlink")]
)
def test_an_agent_asked_to_serve_in_a_directory_others_can_enter_refuses_in_one_line(
    base, make, problem
):
    """The agent checks the directory too, before it binds there: its one line and exit 1 come through the entry
    wrapper (run_command), and nothing is made there."""
    d = link.socket_path(uri_in(base)).parent
    real = make(d)
    before = sorted(os.listdir(real))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tracking.agent", "--listen", str(d / "x.sock")],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        f"tracking agent: the tracking agent's directory {d} "
    ), proc.stderr
    assert problem in proc.stderr and proc.stdout == ""
    assert sorted(os.listdir(real)) == before


def test_a_private_directory_is_made_0700_and_used(base):
    d = link.private_dir(link.socket_path(uri_in(base)).parent)
    st = os.lstat(d)
    assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o700
    assert link.private_problem(d) is None


def test_xdg_runtime_dir_is_used_only_if_it_is_the_users_alone(base, monkeypatch):
    xdg = base / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert link.socket_path("sqlite:///x.db").parent == xdg
    xdg.chmod(0o755)
    assert link.socket_path("sqlite:///x.db").parent == base / f"pipeline-{os.getuid()}"
    xdg.chmod(0o700)
    (base / "xdg-link").symlink_to(xdg)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "xdg-link"))
    assert link.socket_path("sqlite:///x.db").parent == base / f"pipeline-{os.getuid()}"


# --- the log, never opened through a link
class FakeAgent:
    """Popen's stand-in: the agent writes a line to the log it was given, then is gone."""

    def __init__(self, args, stdout=None, **_):
        if isinstance(stdout, int) and stdout >= 0:
            os.write(stdout, b"the agent's log line\n")
        elif hasattr(stdout, "write"):
            stdout.write(b"the agent's log line\n")
            stdout.flush()

    def poll(self):
        return 1


def test_a_link_planted_at_the_log_is_not_followed(base, caplog, monkeypatch, tmp_path):
    caplog.set_level(logging.INFO, logger="pipeline")
    monkeypatch.setattr(link, "Popen", FakeAgent)
    uri = uri_in(base)
    sock, log = link.socket_path(uri), link.socket_path(uri).with_suffix(".log")
    sock.parent.mkdir(mode=0o700, exist_ok=True)
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"not the agent's\n")
    log.symlink_to(sentinel)
    link.spawn(sock)
    assert sentinel.read_bytes() == b"not the agent's\n"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (
        len(warnings) == 1
        and str(log) in warnings[0].getMessage()
        and "symlink" in warnings[0].getMessage()
    )
    log.unlink()
    link.spawn(sock)  # no link: the log is made, the user's alone
    assert (
        log.read_bytes() == b"the agent's log line\n" and (os.lstat(log).st_mode & 0o777) == 0o600
    )


# --- (2) a second user (root plays it through a child that drops to nobody)
class Nobody:
    """A forked child running as uid/gid 65534: `fn(stop_fd, ready)` (ready() says it is set up), its JSON result
    read back once the parent says stop."""

    def __init__(self, fn, *args):
        self.ready_r, ready_w = os.pipe()
        self.result_r, result_w = os.pipe()
        stop_r, self.stop_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: nothing but system calls, then _exit
            code = 0
            try:
                for fd in (
                    self.stop_w,
                    self.ready_r,
                    self.result_r,
                ):  # the parent's ends: its close is the stop
                    os.close(fd)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                result = fn(stop_r, lambda: os.write(ready_w, b"r"), *args)
            except BaseException as e:
                result, code = {"error": repr(e)}, 1
            os.write(result_w, json.dumps(result).encode())
            os._exit(code)
        for fd in (ready_w, result_w, stop_r):
            os.close(fd)
        ready, _, _ = select.select([self.ready_r], [], [], WAIT)
        if not ready or not os.read(self.ready_r, 1):
            self.stop()
            raise AssertionError(f"the child as uid {NOBODY} did not get ready: {self.result}")

    def stop(self) -> dict:
        os.close(self.stop_w)
        chunks = []
        while select.select([self.result_r], [], [], WAIT)[0] and (
            chunk := os.read(self.result_r, 65536)
        ):
            chunks.append(chunk)
        _, _status = os.waitpid(self.pid, 0)
        for fd in (self.ready_r, self.result_r):
            os.close(fd)
        self.result = json.loads(b"".join(chunks) or b"{}")
        return self.result


def squat(
    stop_fd: int,
    ready,
    sock_path: str,
    log_path: str | None = None,
    target: str | None = None,
    make_dir: bool = False,
) -> dict:
    """The other user: its own directory where the user's would be (if make_dir), a listener at the socket's path
    and a link at the log's; every connection and byte it receives until told to stop."""
    if make_dir:
        os.mkdir(os.path.dirname(sock_path), 0o700)
    if log_path and target:
        os.symlink(target, log_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(8)
    ready()
    seen = {"connections": 0, "bytes": 0}
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        readable, _, _ = select.select([server, stop_fd], [], [], 1.0)
        if server in readable:
            conn, _ = server.accept()
            seen["connections"] += 1
            conn.settimeout(5.0)
            try:
                while data := conn.recv(65536):
                    seen["bytes"] += len(data)
            except OSError:
                pass
            conn.close()
        elif stop_fd in readable:
            break
    return seen


def plant_dir_and_link(stop_fd: int, ready, log_path: str, target: str) -> dict:
    os.mkdir(os.path.dirname(log_path), 0o700)
    os.symlink(target, log_path)
    ready()
    select.select([stop_fd], [], [], WAIT)
    return {}


@as_root
def test_another_users_directory_where_the_users_would_be_is_refused_unconnected(
    base, caplog, tmp_path
):
    """The other user makes the directory first (its own, 0700), listens at the socket's path and links the log's
    path to a file of the user's: the job warns once, sends it no byte and writes nothing through the link."""
    uri = uri_in(base)
    sock, log = link.socket_path(uri), link.socket_path(uri).with_suffix(".log")
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"the user's own file\n")
    squatter = Nobody(squat, str(sock), str(log), str(sentinel), sock.parent != base)
    try:
        warnings = track(uri, base / "run", caplog)
    finally:
        seen = squatter.stop()
    assert seen == {"connections": 0, "bytes": 0}, f"the other user's listener was reached: {seen}"
    assert sentinel.read_bytes() == b"the user's own file\n"
    assert len(warnings) == 1 and f"owned by uid {NOBODY}" in warnings[0].getMessage()


@as_root
def test_another_users_directory_with_only_a_link_at_the_log_starts_no_agent_through_it(
    base, caplog, tmp_path
):
    """No listener this time (an agent would be started): the log's link, to a file that does not exist yet, is
    never followed, so the file is never made."""
    uri = uri_in(base)
    log = link.socket_path(uri).with_suffix(".log")
    target = tmp_path / "made-through-the-link"
    if (
        log.parent == base
    ):  # without a directory of its own, the other user plants the link in the temp dir
        os.symlink(target, log)
        os.lchown(log, NOBODY, NOBODY)
        warnings = track(uri, base / "run", caplog)
    else:
        planter = Nobody(plant_dir_and_link, str(log), str(target))
        try:
            warnings = track(uri, base / "run", caplog)
        finally:
            planter.stop()
    assert not target.exists(), "the agent's log was opened through another user's link"
    assert len(warnings) == 1 and f"owned by uid {NOBODY}" in warnings[0].getMessage()


@as_root
def test_the_job_sends_nothing_to_an_agent_of_another_uid(base, caplog):
    """Another user's socket in the user's own private directory (root moves it there: the other user cannot):
    SO_PEERCRED names its uid and the job refuses it before sending a byte, with one warning."""
    uri = uri_in(base)
    sock = link.socket_path(uri)
    sock.parent.mkdir(mode=0o700, exist_ok=True)
    staging = base / "staging.sock"
    squatter = Nobody(squat, str(staging))
    try:
        os.rename(staging, sock)
        warnings = track(uri, base / "run", caplog)
    finally:
        seen = squatter.stop()
    assert seen["bytes"] == 0, f"the job sent {seen['bytes']} bytes to another user's process"
    assert len(warnings) == 1 and f"runs as uid {NOBODY}" in warnings[0].getMessage()


def connect_and_ask(stop_fd: int, ready, sock_path: str) -> dict:
    """The other user as a client: connects, sends a request, and reports whether any answer came."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(sock_path)
    with_answer = "(no answer, and the connection stayed open)"
    c.settimeout(
        30.0
    )  # the refused connection closes at once; this only ends a check of the code without the fix
    with contextlib.suppress(OSError):  # already closed
        c.sendall(b'{"op": "ping", "sid": 1, "uri": "sqlite:///x.db"}\n')
    try:
        with_answer = c.recv(65536).decode(errors="replace")
    except (ConnectionError, BrokenPipeError):
        with_answer = ""
    except OSError:
        pass
    ready()
    return {"answer": with_answer}


@as_root
def test_the_agent_serves_no_client_of_another_uid(base):
    """The agent's accept loop reads nothing from another user's connection (closed at once, unanswered) and
    serves the user's own."""
    public = base / "public"
    public.mkdir()
    public.chmod(0o777)  # so that the other user can reach the socket at all
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(public / "agent.sock"))
    (public / "agent.sock").chmod(0o777)
    server.listen(8)
    inbox: queue.Queue = queue.Queue()
    clients: set = set()
    threading.Thread(target=agent._accept, args=(server, inbox, clients), daemon=True).start()
    try:
        other = Nobody(connect_and_ask, str(public / "agent.sock"))
        result = other.stop()
        assert result.get("answer") == "", f"the other user's connection got {result}"
        with pytest.raises(queue.Empty):
            inbox.get(timeout=1.0)
        assert not clients
        own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own.connect(str(public / "agent.sock"))
        own.sendall(b'{"op": "idle", "sid": 1}\n')
        conn, message = inbox.get(timeout=WAIT)
        assert message == {"op": "idle", "sid": 1} and clients == {conn.cid}
        own.close()
    finally:
        server.close()


# --- every read from the socket is bounded in size
def test_a_line_longer_than_the_bound_ends_the_connection_unbuffered():
    a, b = socket.socketpair()
    a.sendall(b"x" * 5000 + b"\n")
    with pytest.raises(ValueError, match="a line longer than 4096 bytes"):
        link.read_line(b.makefile("rb"), 4096)
    a.sendall(b'{"sid": 1}\n')
    assert link.read_line(b.makefile("rb"), 4096) == b'{"sid": 1}\n'  # a short one passes whole
    a.close()
    b.close()


def test_the_agent_drops_a_connection_sending_an_oversized_request(monkeypatch):
    monkeypatch.setattr(agent, "MAX_REQUEST", 1024)
    a, b = socket.socketpair()
    inbox: queue.Queue = queue.Queue()
    conn = agent.Conn(1, b)
    reader = threading.Thread(target=agent._read, args=(conn, b, inbox), daemon=True)
    reader.start()
    a.sendall(b'{"op": "idle", "sid": 1}\n' + b"y" * 4096)  # the second line never ends
    assert inbox.get(timeout=WAIT)[1] == {"op": "idle", "sid": 1}
    assert (
        inbox.get(timeout=WAIT)[1] is agent.EOF
    )  # the agent stops reading; nothing grows without bound
    reader.join(WAIT)
    a.close()
    b.close()


# --- an agent's files live as long as it does
def agents_serving(sock: Path) -> list[int]:
    """The pids of the running agents listening at `sock` (a zombie's cmdline is empty)."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if (
                proc.name.isdigit()
                and b"pipeline.tracking.agent" in cmd
                and str(sock).encode() in cmd
            ):
                pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_an_agent_that_exits_leaves_nothing_in_the_private_directory(
    tmp_path, base
):  # tmp_path first: not in base
    """Each store tracked has its own agent, socket, lock and log: an idle agent's end takes all of them along (a
    day of tests left hundreds)."""
    out = tmp_path / "out"
    uri = f"sqlite:///{out}/mlflow.db"
    path = link.socket_path(uri)
    assert path.parent.parent == base  # the job's agent lives here too (TMPDIR)
    proc = run_pipeline(
        [*KERNODECK[:1], "trainer.progress_bar=false", f"paths.output_dir={out}"], tmp_path / "cwd"
    )
    assert proc.returncode == 0 and "mlflow tracking (" not in proc.stdout + proc.stderr, (
        proc.stdout[-3000:]
    )
    assert wait_idle(uri)
    deadline = time.monotonic() + WAIT * 5
    while agents_serving(path):  # it exits once idle (PIPELINE_TRACKING_AGENT_IDLE)
        assert time.monotonic() < deadline, "the agent did not exit"
        time.sleep(0.05)
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    assert len(client.search_runs(ids)) == 1  # an agent served the job: its run is indexed
    assert os.listdir(path.parent) == []


def test_an_exiting_agent_keeps_the_files_of_an_agent_serving_its_socket_again(base):
    path = link.socket_path(uri_in(base))
    link.private_dir(path.parent)
    server = listener(path)  # a new agent, started after the old one's socket was gone
    link.socket_path(uri_in(base)).with_suffix(".log").write_bytes(b"the new agent's log\n")
    os.close(link.spawn_lock(path))
    assert not link.remove_agent_files(path)
    assert sorted(os.listdir(path.parent)) == sorted(
        [path.name, f"{path.name}.lock", link.socket_path(uri_in(base)).with_suffix(".log").name]
    )
    server.close()
    path.unlink()  # that one exits too: now they go
    assert link.remove_agent_files(path) and os.listdir(path.parent) == []


def test_a_lock_removed_while_a_spawner_waits_on_it_is_taken_anew(base):
    """A job waiting for the lock an exiting agent holds, and removes: its lock is on a file no other process can
    open any more, so it takes the one at the lock's path now (else two jobs could spawn two agents at once)."""
    path = link.socket_path(uri_in(base))
    link.private_dir(path.parent)
    lock = f"{path}.lock"
    held = link.spawn_lock(path)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(link.spawn_lock(path)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + WAIT
    while (
        sum(
            os.readlink(f"/proc/self/fd/{fd}") == lock
            for fd in os.listdir("/proc/self/fd")
            if os.path.islink(f"/proc/self/fd/{fd}")
        )
        < 2
    ):  # the waiter has the old file open
        assert time.monotonic() < deadline, "the waiter never opened the lock"
        time.sleep(0.01)
    os.unlink(lock)  # as an exiting agent does, holding the lock
    os.close(held)
    waiter.join(WAIT)
    (fd,) = got
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(lock))
    finally:
        os.close(fd)
