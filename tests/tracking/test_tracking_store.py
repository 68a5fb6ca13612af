"""The mlflow store under concurrency and damage: a fresh DB opened by many processes at once, a DB that
cannot be opened (one line, never a traceback), and `reindex --rebuild`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import KERNODECK, env_for_subprocess, run_pipeline, the_run

from pipeline.run.directory import RunDir
from pipeline.tracking import link
from pipeline.tracking.link import wait_idle

pytestmark = pytest.mark.slow


def runs_of(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(ids, max_results=1000)


@pytest.mark.parametrize("repetition", range(5))
def test_independent_runs_and_sweeps_started_together_on_a_fresh_db(tmp_path, repetition):
    """Regression (#11.1): two processes migrating a fresh mlflow.db at once lost runs or broke the DB."""
    out = tmp_path / "out"
    (tmp_path / "cwd").mkdir()
    base = [*KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false"]
    py = [sys.executable, "-m", "pipeline"]
    commands = [[*py, *base, f"trainer.seed={s}"] for s in range(4)] + [
        [*py, "-m", *base, f"optimizer.lr={a},{b}", f"trainer.seed={10 + i}"]
        for i, (a, b) in enumerate(((0.01, 0.02), (0.03, 0.04)))
    ]
    procs = [
        subprocess.Popen(
            c,
            cwd=tmp_path / "cwd",
            env=env_for_subprocess(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in commands
    ]
    logs = [p.communicate()[0] for p in procs]
    assert wait_idle(f"sqlite:///{out}/mlflow.db")  # the agent completes the index after the jobs
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
        for bad in (
            "mlflow tracking (",
            "Traceback",
            "already exists",
            "duplicate column",
            "OperationalError",
        ):
            assert bad not in log, log[-3000:]
    client, runs = runs_of(f"sqlite:///{out}/mlflow.db")
    children = [r for r in runs if r.data.tags.get("sweep") != "parent"]
    assert len(children) == 8 and len(runs) == 10  # 4 runs, 2 x 2 jobs, 2 parents: none lost
    for run in children:
        assert run.info.status == "FINISHED"
        lines = RunDir(Path(run.data.tags["run_dir"])).read_metrics()
        for key in ("train/loss", "lr", "grad_norm"):
            history = sorted(
                (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
            )
            assert history == [(ln["step"], ln[key]) for ln in lines], key  # every point, once


def test_a_db_that_cannot_be_opened_is_one_line_and_rebuild_moves_it_aside(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlflow.db").write_bytes(b"this is not a sqlite database" * 100)
    proc = run_pipeline(
        [*KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false"], tmp_path / "cwd"
    )
    assert proc.returncode == 0, proc.stderr[
        -3000:
    ]  # training goes on, the manifests are the truth
    log = proc.stdout + proc.stderr
    assert log.count("is off for the rest of this run") == 1 and "Traceback" not in log
    assert "reindex --rebuild" in log
    reindex = [sys.executable, "-m", "pipeline.reindex", str(out)]
    refused = subprocess.run(reindex, env=env_for_subprocess(), capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "--rebuild" in refused.stderr
    rebuilt = subprocess.run(
        [*reindex, "--rebuild"], env=env_for_subprocess(), capture_output=True, text=True
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    (aside,) = out.glob("mlflow.db.broken-*")
    assert aside.read_bytes() == b"this is not a sqlite database" * 100  # kept, not deleted
    client, runs = runs_of(f"sqlite:///{out}/mlflow.db")
    (run,) = runs
    assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(the_run(out))
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 10


def test_a_fresh_store_keeps_every_artifact_under_the_output_directory(tmp_path):
    """mlflow's own Default experiment pointed at <cwd>/mlruns; reindex into another sqlite URI too."""
    out = tmp_path / "out"
    assert (
        run_pipeline([*KERNODECK[:1], f"paths.output_dir={out}"], tmp_path / "cwd").returncode == 0
    )
    assert wait_idle(f"sqlite:///{out}/mlflow.db")
    from mlflow import MlflowClient

    for uri in (f"sqlite:///{out}/mlflow.db", f"sqlite:///{tmp_path}/elsewhere/index.db"):
        if "elsewhere" in uri:
            r = subprocess.run(
                [sys.executable, "-m", "pipeline.reindex", str(out), "--tracking-uri", uri],
                cwd=tmp_path / "cwd",
                env=env_for_subprocess(),
                capture_output=True,
                text=True,
            )
            assert r.returncode == 0, r.stdout + r.stderr
        for e in MlflowClient(uri).search_experiments():
            assert e.artifact_location.startswith(f"file://{out}/mlartifacts"), (
                uri,
                e.name,
                e.artifact_location,
            )
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_store_path_that_is_not_a_file_is_named_without_waiting_on_it(tmp_path, kind):
    """A FIFO where mlflow.db should be would block a plain open() until a writer came: refused from its stat."""
    from pipeline.tracking.common import store_problem

    db = tmp_path / "mlflow.db"
    if kind == "fifo":
        os.mkfifo(db)
    else:
        db.mkdir()
    problem = store_problem(f"sqlite:///{db}")
    assert problem is not None and problem.startswith(
        f"the mlflow store {db} cannot be opened: is a"
    )
    assert db.exists()  # left as it was


@pytest.mark.parametrize("entry", ["mlflow.db", "mlartifacts"])
def test_a_link_at_the_store_or_its_artifacts_is_refused_by_every_opener(tmp_path, entry):
    """open_store (the agent's, register's, reindex's): a dangling mlflow.db link would create the store at its
    target, a linked mlartifacts would receive the artifacts; refused in one line naming it, the target untouched."""
    from pipeline.tracking.store import StoreError, open_store

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere / "new.db" if entry == "mlflow.db" else elsewhere, out / entry)
    with pytest.raises(StoreError) as e:
        open_store(f"sqlite:///{out / 'mlflow.db'}")
    assert f"{out / entry} is a symlink" in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(out)) == [entry]


def test_a_store_removed_while_its_agent_runs_is_made_anew_by_the_next_job(tmp_path, monkeypatch):
    """`rm -rf outputs` and the same command again, while the first job's agent still runs: the agent notices its
    store is not the file it opened and opens the new one (it wrote to the deleted file: a read-only database)."""
    monkeypatch.setenv(
        "PIPELINE_TRACKING_AGENT_IDLE", "600"
    )  # one agent for both jobs, as in a working session
    out = tmp_path / "outputs"
    uri = f"sqlite:///{out}/mlflow.db"
    args = [*KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false"]
    agent_pid = None
    try:
        for attempt in range(2):
            if attempt:
                shutil.rmtree(out)
            proc = run_pipeline(args, tmp_path / "cwd")
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "mlflow tracking (" not in log, log[-3000:]
            assert wait_idle(uri)
            sock = link._connect(link.socket_path(uri))
            assert sock is not None, "no agent serves the store"
            pid = link.peer_credentials(sock)[0]
            sock.close()
            assert agent_pid in (None, pid), (
                "the second job was served by a new agent: nothing tested"
            )
            agent_pid = pid
            client, runs = runs_of(uri)
            (run,) = runs
            assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(the_run(out))
            assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 10
    finally:
        if agent_pid is not None:
            os.kill(
                agent_pid, signal.SIGKILL
            )  # it ignores the signals jobs get; its files go with it below
            wait_gone(agent_pid)
            link.socket_path(uri).unlink(missing_ok=True)
            link.remove_agent_files(link.socket_path(uri))


def wait_gone(pid: int) -> None:
    """Wait (at most a generous 600 s) until `pid` has exited, reaped or not."""
    for _ in range(60000):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX":
                return
        except OSError:
            return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not exit")
