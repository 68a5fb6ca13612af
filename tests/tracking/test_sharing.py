"""A sqlite store shared beyond one machine (on a network filesystem, or opened from several hosts) is named in
one warning with the team setup to use instead; a store on a local disk opened from one host is not."""

from __future__ import annotations

import logging
import socket

import pytest

from pipeline.tracking import store
from pipeline.tracking.mlflow_tracker import MlflowTracker

WAIT = 120.0  # seconds: a generous bound on the agent's answers (a loaded machine is slow)


def opened(uri: str, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        store.open_store(uri)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def mounts(monkeypatch, *lines: str) -> None:
    monkeypatch.setattr(store, "read_mounts", lambda: "".join(f"{ln}\n" for ln in lines))


def test_a_store_on_nfs_gets_one_warning_naming_the_server_setup(tmp_path, monkeypatch, caplog):
    mounts(
        monkeypatch,
        "/dev/sda1 / ext4 rw 0 0",
        f"fileserver:/export {tmp_path / 'shared'} nfs4 rw 0 0",
    )
    (warning,) = opened(f"sqlite:///{tmp_path}/shared/out/mlflow.db", caplog)
    assert f"{tmp_path}/shared/out/mlflow.db is on a network filesystem (nfs4)" in warning
    assert "mlflow server --backend-store-uri postgresql+psycopg://" in warning
    assert "tracking=server tracking.uri=http://" in warning


@pytest.mark.parametrize("kind", ["lustre", "cifs", "gpfs"])
def test_other_network_filesystems_too(tmp_path, monkeypatch, caplog, kind):
    mounts(monkeypatch, "/dev/sda1 / ext4 rw 0 0", f"x {tmp_path} {kind} rw 0 0")
    (warning,) = opened(f"sqlite:///{tmp_path}/mlflow.db", caplog)
    assert f"network filesystem ({kind})" in warning


def test_a_local_store_of_one_host_gets_none(tmp_path, monkeypatch, caplog):
    # the nearest mount point decides: a local disk mounted under a network one
    mounts(
        monkeypatch,
        "/dev/sda1 / ext4 rw 0 0",
        f"srv:/x {tmp_path} nfs rw 0 0",
        f"/dev/sdb1 {tmp_path}/local xfs rw 0 0",
    )
    uri = f"sqlite:///{tmp_path}/local/mlflow.db"
    assert opened(uri, caplog) == []
    assert opened(uri, caplog) == []  # the same host again


def test_a_store_opened_from_a_second_host_gets_one_warning(tmp_path, monkeypatch, caplog):
    mounts(monkeypatch, "/dev/sda1 / ext4 rw 0 0")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-a")
    assert opened(uri, caplog) == []
    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-b")
    (warning,) = opened(uri, caplog)
    assert "opened by jobs on 2 hosts (node-a, node-b)" in warning and "postgresql" in warning


def test_a_job_on_a_store_another_host_opened_says_so_on_its_own_output(
    tmp_path, monkeypatch, caplog
):
    """The store is opened by the tracking agent, in its own process with its own log: its warning reaches the
    job's output, once."""
    uri = f"sqlite:///{tmp_path}/out/mlflow.db"
    with monkeypatch.context() as m:
        m.setattr(store.socket, "gethostname", lambda: "another-node")
        store.open_store(uri)  # a job of another host made the store
    caplog.clear()
    caplog.set_level(logging.INFO, logger="pipeline")
    tracker = MlflowTracker(uri=uri, experiment="e", artifact_location=None, wait=1.0)
    tracker.prepare()
    assert tracker.warm.wait(WAIT), "the agent did not open the store"
    tracker.start(config={"name": "e"}, facts={}, run_dir=tmp_path / "run", previous_run_uri=None)
    assert tracker.ready.wait(WAIT) and not tracker.failed
    tracker.finish("FINISHED", tmp_path / "run")
    assert tracker.done.wait(WAIT), "the agent did not complete the run"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    (warning,) = warnings
    me = socket.gethostname()
    assert f"opened by jobs on 2 hosts ({', '.join(sorted(['another-node', me]))})" in warning
    assert "--allowed-hosts" in warning and "docs/tracking.md: Team setup" in warning
