"""Real tracking servers for the tests: `mlflow server` on a sqlite file or on a PostgreSQL started here."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

POSTGRES_HOW = "install Debian's `postgresql` package (`.ci/run` does, as root)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(
    root: Path,
    *store_args: str,
    backend: str | None = None,
    command: str = "server",
    port: int | None = None,
):
    """A real `mlflow server` (or `mlflow ui`: `command`) on 127.0.0.1 and `port` (by default a free one) (its
    store `backend`, by default a sqlite file under `root`, and `store_args`), up until the block ends: yields its
    URI."""

    def healthy(uri: str) -> bool:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    port = port or free_port()
    log = open(root / f"{command}.log", "w")  # noqa: SIM115 - the server's output for its lifetime, closed with it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            command,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            backend or f"sqlite:///{root}/srv.db",
            *store_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=root,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # no job runners
    uri = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()  # a generous limit: a loaded machine is slow
        while not healthy(uri) and proc.poll() is None and time.monotonic() - t0 < 600:
            time.sleep(0.1)
        if not healthy(uri):
            said = (root / f"{command}.log").read_text()[-3000:]
            pytest.fail(f"mlflow {command} not up (exit {proc.poll()}): {said}")
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def postgres_bin() -> Path | None:
    """The directory of PostgreSQL's server programs: on PATH, or Debian's /usr/lib/postgresql/<version>/bin
    (the newest), where the package puts them off PATH; None if there are none."""
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).resolve().parent
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3])
    )
    return Path(found[-1]).parent if found else None


def postgres_unavailable() -> str | None:
    """Why no PostgreSQL can be started here, in one line; None when one can."""
    if postgres_bin() is None:
        return f"postgres tests skipped: no PostgreSQL server programs (pg_ctl, initdb); {POSTGRES_HOW}"
    try:
        import psycopg  # noqa: F401  (mlflow's driver for postgresql+psycopg://)
    except ImportError:
        return "postgres tests skipped: no psycopg; pip install -e '.[postgres]'"
    return None


@contextlib.contextmanager
def postgres_instance():
    """A throwaway PostgreSQL on 127.0.0.1 and a free port, its cluster in a temporary directory, with an empty
    database `mlflow`: yields its SQLAlchemy URI (mlflow's). Run as `nobody` when we are root: postgres refuses
    to run as root. Stopped and removed when the block ends."""
    bindir = postgres_bin()
    root = Path(
        tempfile.mkdtemp(prefix="pipeline-tests-postgres-")
    )  # in /tmp: `nobody` can reach it
    data, port = root / "data", free_port()
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    if as_user:
        os.chown(root, 65534, 65534)

    def run(*args: str) -> None:
        proc = subprocess.run([*as_user, *args], capture_output=True, text=True, cwd=root)
        if proc.returncode != 0:
            pytest.fail(
                f"{' '.join(args[:2])} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"
            )

    try:
        run(
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        run(
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "postgres.log"),
            "-w",
            "-t",
            "300",
            "-o",
            f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off",
            "start",
        )
        try:
            run(
                str(bindir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
                "mlflow",
            )
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/mlflow"
        finally:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    """The SQLAlchemy URI of a PostgreSQL database for the session; skips (one line, saying how to enable)
    without the server programs or the driver."""
    why = postgres_unavailable()
    if why:
        pytest.skip(why)
    with postgres_instance() as uri:
        yield uri


@pytest.fixture(scope="session")
def postgres_mlflow_server(postgres, tmp_path_factory):
    """(URI, artifacts destination) of one `mlflow server` on the session's PostgreSQL: the team setup."""
    root = tmp_path_factory.mktemp("mlflow-postgres-server")
    with mlflow_server(
        root, "--artifacts-destination", str(root / "server-artifacts"), backend=postgres
    ) as uri:
        yield uri, root / "server-artifacts"
