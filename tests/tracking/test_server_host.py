"""The team setup reached from another node: jobs name the server by a host name (`http://SERVERHOST:5000`), not
localhost. mlflow's server refuses a host name it was not given with `--allowed-hosts` (403, "Invalid Host
header"): the job says so in one warning naming the fix, and with the fix its run is tracked. Only the loopback
is contacted: the server listens on 127.0.0.1 and the host name resolves there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import KERNODECK, run_pipeline, the_run
from mlflow import MlflowClient
from mlflow_servers import free_port, mlflow_server

from pipeline.tracking.link import wait_idle

pytestmark = pytest.mark.slow


def loopback_name() -> str:
    """A name for 127.0.0.1 that is neither `localhost` nor `127.0.0.1`: the machine's own host name where it
    resolves there (as `$(hostname)` in docs/slurm.md), else `127.1` (the address's short form)."""
    name = socket.gethostname()
    try:
        if name != "localhost" and socket.gethostbyname(name) == "127.0.0.1":
            return name
    except OSError:
        pass
    return "127.1"


def job(server: str, out: Path) -> list[str]:
    return [
        *KERNODECK[:1],
        "trainer.progress_bar=false",
        "tracking=server",
        f"tracking.uri={server}",
        "tracking.experiment=team-host",
        f"paths.output_dir={out}",
    ]


def test_a_server_reached_by_host_name_needs_allowed_hosts_and_the_job_says_so(tmp_path):
    name = loopback_name()
    assert socket.gethostbyname(name) == "127.0.0.1"  # never anything but the loopback
    port = free_port()
    with mlflow_server(
        tmp_path, port=port
    ) as local:  # as docs/tracking.md had it: no --allowed-hosts
        proc = run_pipeline(job(f"http://{name}:{port}", tmp_path / "out1"), tmp_path / "cwd")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert wait_idle(f"http://{name}:{port}")
        said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "mlflow tracking (" in ln]
        assert len(said) == 1 and "Invalid Host header" in said[0], proc.stdout[-3000:]
        assert (
            f"--allowed-hosts {name}:{port}" in said[0]
        )  # the fix, as the server must be given it
        assert MlflowClient(local).search_runs(["0"]) == []  # nothing reached the store

    port = free_port()
    server = f"http://{name}:{port}"
    with mlflow_server(tmp_path, "--allowed-hosts", f"{name}:{port}", port=port):
        proc = run_pipeline(job(server, tmp_path / "out2"), tmp_path / "cwd")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "mlflow tracking (" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
        assert wait_idle(server)
        client = MlflowClient(
            server
        )  # mlflow's own client: the oracle (the flag replaces localhost's defaults)
        exp = client.get_experiment_by_name("team-host")
        (run,) = client.search_runs([exp.experiment_id])
        assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(
            the_run(tmp_path / "out2").resolve()
        )
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) > 0
