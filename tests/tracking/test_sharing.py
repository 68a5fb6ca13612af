"""A sqlite store shared beyond one machine (on a network filesystem, or opened from several hosts) is named in
one warning with the team setup to use instead; a store on a local disk opened from one host is not."""
from __future__ import annotations

import logging

import pytest

from pipeline.tracking import sharing, store


def opened(uri: str, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        store.open_client(uri)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def mounts(monkeypatch, *lines: str) -> None:
    monkeypatch.setattr(sharing, "read_mounts", lambda: "".join(f"{ln}\n" for ln in lines))


def test_a_store_on_nfs_gets_one_warning_naming_the_server_setup(tmp_path, monkeypatch, caplog):
    mounts(monkeypatch, "/dev/sda1 / ext4 rw 0 0", f"fileserver:/export {tmp_path / 'shared'} nfs4 rw 0 0")
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
    mounts(monkeypatch, "/dev/sda1 / ext4 rw 0 0", f"srv:/x {tmp_path} nfs rw 0 0",
           f"/dev/sdb1 {tmp_path}/local xfs rw 0 0")
    uri = f"sqlite:///{tmp_path}/local/mlflow.db"
    assert opened(uri, caplog) == []
    assert opened(uri, caplog) == []  # the same host again


def test_a_store_opened_from_a_second_host_gets_one_warning(tmp_path, monkeypatch, caplog):
    mounts(monkeypatch, "/dev/sda1 / ext4 rw 0 0")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setattr(sharing.socket, "gethostname", lambda: "node-a")
    assert opened(uri, caplog) == []
    monkeypatch.setattr(sharing.socket, "gethostname", lambda: "node-b")
    (warning,) = opened(uri, caplog)
    assert "opened by jobs on 2 hosts (node-a, node-b)" in warning and "postgresql" in warning
