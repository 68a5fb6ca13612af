"""Multiruns tracked as one parent mlflow run with a child per job, across launchers, sweepers and stores.

Every sweep is `python -m pipeline -m experiment=kernodeck paths.output_dir=<tmp> ...` in a subprocess.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.tracking.common import parse_run_uri

PROJECT_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def premigrated_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / "mlflow-template-sweeps.db"
    if not path.exists():
        from mlflow import MlflowClient

        MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def sweep(pipeline_runner, out: Path, *overrides: str, timeout: float = 240):
    return pipeline_runner(["-m", "experiment=kernodeck", f"paths.output_dir={out}", *overrides],
                           cwd=out.parent / "cwd", timeout=timeout)


def family(uri: str):
    """(parents, children) of every run in the store."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def check_family(uri: str, out: Path, n_children: int, status: str = "FINISHED"):
    client, parents, children = family(uri)
    assert len(parents) == 1, [p.data.tags.get("mlflow.runName") for p in parents]
    (parent,) = parents
    assert parent.data.tags.get("sweep") == "parent"
    assert parent.info.status == status
    assert len(children) == n_children
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert {c.info.experiment_id for c in children} == {parent.info.experiment_id}
    return client, parent, children


def check_finished_child(client, child, out: Path):
    assert child.info.status == "FINISHED"
    run_dir = Path(child.data.tags["run_dir"])
    assert run_dir.parent == (out / "runs").resolve()
    final = json.loads((run_dir / "checkpoints" / "final" / "manifest.json").read_text())
    assert parse_run_uri(final["mlflow_run_uri"])[2] == child.info.run_id
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(client.get_metric_history(child.info.run_id, "train/loss")) == len(lines) == 10


def no_tracking_trouble(proc) -> None:
    log = proc.stdout + proc.stderr
    for bad in ("mlflow tracking (", "could not", "OperationalError", "already exists", "duplicate column"):
        assert bad not in log, log[-4000:]


def test_joblib_four_parallel_jobs_on_a_fresh_db(pipeline_runner, tmp_path):
    out = tmp_path / "out"
    proc = sweep(pipeline_runner, out, "hydra/launcher=joblib", "hydra.launcher.n_jobs=4",
                 "optimizer.lr=0.01,0.03", "model.hidden=[4],[8]")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    no_tracking_trouble(proc)
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", out, 4)
    for child in children:
        check_finished_child(client, child, out)
    assert parent.data.metrics["best/val/loss"] == min(c.data.metrics["val/loss"] for c in children)


def test_a_failing_job_leaves_its_child_and_the_parent_failed(pipeline_runner, tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(premigrated_db(tmp_path_factory), out / "mlflow.db")
    proc = sweep(pipeline_runner, out, "trainer.batch_size=4,100")  # 100 > the 24 rows: the job raises
    assert proc.returncode != 0
    assert "trainer.batch_size=100" in proc.stdout + proc.stderr
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", out, 2, status="FAILED")
    by_status = {c.info.status: c for c in children}
    assert set(by_status) == {"FINISHED", "FAILED"}
    check_finished_child(client, by_status["FINISHED"], out)
    failed = by_status["FAILED"]
    assert "trainer.batch_size=100" in failed.data.tags["error"]
    assert failed.data.params["trainer.batch_size"] == "100"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 and a free port, with its own sqlite store and artifact root."""
    root = tmp_path_factory.mktemp("server")
    shutil.copy(premigrated_db(tmp_path_factory), root / "srv.db")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/srv.db",
                             "--default-artifact-root", str(root / "art")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not come up: {(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_a_tracking_server_receives_a_two_job_sweep(pipeline_runner, tmp_path, mlflow_server):
    out = tmp_path / "out"
    proc = sweep(pipeline_runner, out, "tracking=server", f"tracking.uri={mlflow_server}", "optimizer.lr=0.01,0.03")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    no_tracking_trouble(proc)
    assert not (out / "mlflow.db").exists()
    client, parent, children = check_family(mlflow_server, out, 2)
    for child in children:
        check_finished_child(client, child, out)
        files = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"curves.png", "final", "checkpoints"} <= files
        run_uri = json.loads((Path(child.data.tags["run_dir"]) / "checkpoints/final/manifest.json").read_text())[
            "mlflow_run_uri"]
        assert run_uri.startswith(f"{mlflow_server}#/experiments/")


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')")
def test_submitit_local_two_job_sweep(pipeline_runner, tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(premigrated_db(tmp_path_factory), out / "mlflow.db")
    proc = sweep(pipeline_runner, out, "hydra/launcher=submitit_local", "optimizer.lr=0.01,0.03")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", out, 2)
    for child in children:
        check_finished_child(client, child, out)


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="hydra-optuna-sweeper is not installed (pip install -e '.[optuna]')")
def test_optuna_three_trials_minimise_val_loss_and_are_logged(pipeline_runner, tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(premigrated_db(tmp_path_factory), out / "mlflow.db")
    proc = sweep(pipeline_runner, out, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                 "optimizer.lr=interval(0.001,0.1)")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", out, 3)
    for child in children:
        check_finished_child(client, child, out)
    best = min(c.data.metrics["val/loss"] for c in children)
    log = proc.stdout + proc.stderr
    assert f"Best value: {best}" in log, log[-2000:]  # the sweeper minimised the val/loss the jobs returned
    assert len({c.data.params["optimizer.lr"] for c in children}) == 3
