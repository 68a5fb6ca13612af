"""Multiruns as one sweep: a stable identity, one parent mlflow run with a child per job (named by its swept
values), failures that fail only their job, interruption that reaches every job and resumes under the same
parent, and the same structure on a tracking server. Every sweep is `python -m pipeline -m ...`."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import KERNODECK, SHARED_SERVER, Proc, env_for_subprocess, run_pipeline, wait_until

from pipeline.run.directory import RunDir
from pipeline.run.signals import descendants
from pipeline.tracking.common import parse_run_uri
from pipeline.tracking.link import wait_idle

pytestmark = pytest.mark.slow


def settle(uri: str) -> None:
    """The command has returned; the tracking agent completes the index after it: wait for that."""
    assert wait_idle(uri), f"the tracking agent for {uri} went away before the index was complete"


def sweep(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = run_pipeline(
        ["-m", *KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false", *overrides],
        out.parent / "cwd",
    )
    uri = next(
        (o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri=")),
        f"sqlite:///{out}/mlflow.db",
    )
    settle(uri)
    return proc


def family(uri: str, experiment: str | None = None):
    """(client, parents, children) of every run in the store, or in its `experiment`."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments() if experiment in (None, e.name)]
    runs = client.search_runs(ids, max_results=1000)
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def check_family(
    uri: str,
    n_children: int,
    status: str = "FINISHED",
    jobs: int | None = None,
    experiment: str | None = None,
):
    client, parents, children = family(uri, experiment)
    assert len(parents) == 1, [p.data.tags.get("mlflow.runName") for p in parents]
    (parent,) = parents
    assert parent.info.status == status, parent.data.tags
    assert len(children) == n_children, [c.data.tags.get("mlflow.runName") for c in children]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert parent.data.tags["sweep.jobs"] == str(n_children if jobs is None else jobs)
    return client, parent, children


def check_finished_child(client, child, out: Path, steps: int = 10):
    assert child.info.status == "FINISHED"
    run_dir = Path(child.data.tags["run_dir"])
    assert run_dir.parent == (out / "runs").resolve()
    final = json.loads((RunDir(run_dir).store.link_dir("final") / "manifest.json").read_text())
    # the final manifest names the run if its URI was known by then; run.json names it in any case
    assert parse_run_uri(final["mlflow_run_uri"])[2] in (None, child.info.run_id)
    assert parse_run_uri(RunDir(run_dir).read_status()["mlflow_run_uri"])[2] == child.info.run_id
    assert (
        len(client.get_metric_history(child.info.run_id, "train/loss"))
        == len(RunDir(run_dir).read_metrics())
        == steps
    )


def no_tracking_trouble(proc) -> None:
    log = proc.stdout + proc.stderr
    for bad in (
        "mlflow tracking (",
        "could not",
        "OperationalError",
        "already exists",
        "duplicate column",
        "Traceback",
    ):
        assert bad not in log, log[-4000:]


def test_joblib_four_parallel_jobs_on_a_fresh_db(tmp_path):
    out = tmp_path / "out"
    proc = sweep(
        out,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=4",
        "optimizer.lr=0.01,0.03",
        "model.hidden=[4],[8]",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    no_tracking_trouble(proc)
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", 4)
    for child in children:
        check_finished_child(client, child, out)
    names = sorted(c.data.tags["mlflow.runName"] for c in children)
    assert names == sorted(
        f"optimizer.lr={lr} model.hidden=[{h}]" for lr in ("0.01", "0.03") for h in (4, 8)
    ), names
    assert sorted(c.data.tags["sweep.job_num"] for c in children) == ["0", "1", "2", "3"]
    assert all("optimizer.lr=" in c.data.tags["sweep.job_overrides"] for c in children)
    assert all(
        "paths.output_dir" not in c.data.params and c.data.tags["model.parameters"]
        for c in children
    )
    best = min(children, key=lambda c: c.data.metrics["best/val/loss"])
    assert parent.data.tags["best.run_id"] == best.info.run_id
    assert parent.data.metrics["best/val/loss"] == best.data.metrics["best/val/loss"]
    assert parent.data.params == {"optimizer.lr": "0.01,0.03", "model.hidden": "[4],[8]"}
    files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"multirun.yaml", "sweep.json"} <= files


def test_a_failing_job_fails_only_itself_and_the_sweep_says_which(tmp_path):
    out = tmp_path / "out"
    proc = sweep(out, "trainer.batch_size=4,100,8")  # 100 > the 24 rows: job 1 is bad input
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("pipeline: 1 of 3 jobs failed: job 1 (trainer.batch_size=100)")
        and "24" in last
    )
    client, parent, children = check_family(
        f"sqlite:///{out}/mlflow.db", 2, status="FAILED", jobs=3
    )
    for child in children:  # the jobs after the failed one ran
        check_finished_child(client, child, out)
    assert (
        parent.data.tags["sweep.failed"] == "1"
        and "trainer.batch_size=100" in parent.data.tags["sweep.failures"]
    )


def test_a_busy_job_fails_only_itself(tmp_path):
    out = tmp_path / "out"
    busy = Proc(
        [
            *KERNODECK,
            "trainer.max_steps=200000",
            "checkpoint=every_n_steps",
            "checkpoint.every_steps=100000",
            "trainer.log_every=1000",
            f"paths.output_dir={out}",
        ],
        tmp_path / "cwd",
    )
    try:
        wait_until(
            lambda: (
                any((out / "runs").glob("*/metrics.jsonl")) if (out / "runs").exists() else False
            ),
            "the busy run to start",
            busy,
        )
        proc = sweep(
            out,
            "tracking=none",
            "trainer.max_steps=200000,10",
            "checkpoint=every_n_steps",
            "checkpoint.every_steps=100000",
            "trainer.log_every=1000",
        )
        assert proc.returncode == 2, (proc.stdout + proc.stderr)[-4000:]
        assert (
            "1 of 2 jobs failed: job 0" in proc.stderr
            and "in use by another process" in proc.stderr
        )
        assert "done at step 10" in proc.stdout  # the next job ran
    finally:
        busy.send_signal(signal.SIGTERM)
        busy.wait()


def test_rerunning_a_sweep_reuses_its_parent_and_retrains_nothing(tmp_path):
    out = tmp_path / "out"
    args = ("optimizer.lr=0.01,0.03",)
    assert sweep(out, *args).returncode == 0
    _, parent, children = check_family(f"sqlite:///{out}/mlflow.db", 2)
    weights = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("weights.safetensors")}
    again = sweep(out, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("is complete at step 10") == 2
    _client, parent2, children2 = check_family(f"sqlite:///{out}/mlflow.db", 2)
    assert parent2.info.run_id == parent.info.run_id
    assert {c.info.run_id for c in children2} == {c.info.run_id for c in children}
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("weights.safetensors")} == weights
    assert len(list((out / "sweeps").iterdir())) == 1  # one sweep, one directory
    other = sweep(out, "optimizer.lr=0.01,0.05")  # another sweep: its own directory and parent
    assert other.returncode == 0, other.stderr
    _, parents, _ = family(f"sqlite:///{out}/mlflow.db")
    assert len(parents) == 2 and len(list((out / "sweeps").iterdir())) == 2
    by_id = {p.data.tags["sweep.id"]: p for p in parents}
    second = next(p for p in parents if p.info.run_id != parent.info.run_id)
    _, _, all_children = family(f"sqlite:///{out}/mlflow.db")
    mine = [c for c in all_children if c.data.tags["mlflow.parentRunId"] == second.info.run_id]
    assert (
        len(mine) == 2
    )  # the job it shares with the first sweep shows here too, pointing at that run
    assert sum("repeat_of" in c.data.tags for c in mine) == 1 and len(by_id) == 2


def test_an_interrupted_joblib_sweep_stops_every_job_and_the_same_command_finishes_it(tmp_path):
    out = tmp_path / "out"
    long = (
        "trainer.max_steps=40000",
        "trainer.log_every=100",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=5000",
        "trainer.eval_every=10000",
    )
    args = [
        "-m",
        *KERNODECK[:1],
        f"paths.output_dir={out}",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "optimizer.lr=0.01,0.02,0.03,0.04",
        *long,
    ]
    launcher = Proc(args, tmp_path / "cwd")

    def running() -> int:
        return (
            sum(
                1 for p in (out / "runs").glob("*/metrics.jsonl") if RunDir(p.parent).read_metrics()
            )
            if (out / "runs").exists()
            else 0
        )

    wait_until(lambda: running() >= 2, "two jobs training", launcher)
    workers = descendants(launcher.p.pid)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait() == 75, launcher.stderr[-4000:]
    settle(f"sqlite:///{out}/mlflow.db")
    assert "the sweep was interrupted" in launcher.stderr and "Traceback" not in launcher.stderr
    for pid in workers:  # no process left behind
        wait_until(
            lambda pid=pid: (
                not Path(f"/proc/{pid}").exists()
                or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            ),
            f"worker {pid} to exit",
        )
    statuses = {p.name: RunDir(p).read_status().get("status") for p in (out / "runs").iterdir()}
    assert "preempted" in statuses.values() and "running" not in statuses.values(), statuses
    client, parent, children = check_family(
        f"sqlite:///{out}/mlflow.db", len(statuses), status="KILLED", jobs=4
    )
    assert {c.info.status for c in children} <= {"KILLED", "FINISHED"}
    finished = run_pipeline(args, tmp_path / "cwd")
    assert finished.returncode == 0, finished.stderr[-4000:]
    settle(f"sqlite:///{out}/mlflow.db")
    client, parent2, children = check_family(f"sqlite:///{out}/mlflow.db", 4)
    assert parent2.info.run_id == parent.info.run_id
    for child in children:
        check_finished_child(client, child, out, steps=40000 // 100)
        tags = child.data.tags
        if RunDir(Path(tags["run_dir"])).read_status().get("resumes"):
            assert tags["resumes"] == "1"


@pytest.fixture
def mlflow_server(shared_mlflow_server):
    return shared_mlflow_server[0]


@SHARED_SERVER
def test_a_tracking_server_receives_the_same_structure(tmp_path, mlflow_server):
    out = tmp_path / "out"
    proc = sweep(
        out,
        "tracking=server",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=same-structure",
        "optimizer.lr=0.01,0.03",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    no_tracking_trouble(proc)
    assert not (out / "mlflow.db").exists()
    client, _parent, children = check_family(mlflow_server, 2, experiment="same-structure")
    for child in children:
        check_finished_child(client, child, out)
        files = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"curves.png", "final", "checkpoints", "hydra"} <= files
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == [
        "optimizer.lr=0.01",
        "optimizer.lr=0.03",
    ]


@SHARED_SERVER
def test_mlflow_tracking_uri_from_the_environment_wins(tmp_path, mlflow_server):
    out = tmp_path / "out"
    env = {
        **env_for_subprocess(),
        "MLFLOW_TRACKING_URI": mlflow_server,
        "MLFLOW_EXPERIMENT_NAME": "from-env",
    }
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *KERNODECK[:1], f"paths.output_dir={out}"],
        cwd=tmp_path / "cwd",
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    settle(mlflow_server)
    assert f"mlflow: tracking into {mlflow_server} (experiment from-env)" in proc.stdout
    assert not (out / "mlflow.db").exists()
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("from-env").experiment_id])
    assert run.info.status == "FINISHED"


def test_submitit_local_two_job_sweep(tmp_path):
    out = tmp_path / "out"
    proc = sweep(out, "hydra/launcher=submitit_local", "optimizer.lr=0.01,0.03")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    client, _parent, children = check_family(f"sqlite:///{out}/mlflow.db", 2)
    for child in children:
        check_finished_child(client, child, out)


def test_optuna_trials_are_children_repeats_included_and_the_direction_follows_best_val(tmp_path):
    out = tmp_path / "out"
    # two choices for four trials: some trial repeats a configuration, and each is a child of its own
    proc = sweep(
        out,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=choice(0.01,0.03)",
        "stages.best_val.mode=max",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    client, parent, children = check_family(f"sqlite:///{out}/mlflow.db", 4)
    assert sum("repeat_of" in c.data.tags for c in children) >= 2
    best = max(c.data.metrics["best/val/loss"] for c in children)  # mode=max: the sweeper maximised
    assert f"Best value: {best}" in proc.stdout + proc.stderr
    results = next((out / "sweeps").iterdir()) / "optimization_results.yaml"
    assert f"best_value: {best}" in results.read_text()
    assert "optimization_results.yaml" in {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }


def test_reindex_of_a_deleted_db_reproduces_the_live_index(tmp_path):
    out = tmp_path / "out"
    assert (
        sweep(
            out, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=0.01,0.03"
        ).returncode
        == 0
    )
    assert (
        run_pipeline(
            [*KERNODECK[:1], f"paths.output_dir={out}", "model.hidden=[4]"], tmp_path / "cwd"
        ).returncode
        == 0
    )
    settle(f"sqlite:///{out}/mlflow.db")

    def index(uri):
        client, _parents, _children = family(uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, max_results=1000)
        name_of = {r.info.run_id: r.data.tags.get("mlflow.runName") for r in runs}
        out_ = {}
        for r in runs:
            metrics = {
                k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
                for k in r.data.metrics
            }
            out_[r.data.tags.get("mlflow.runName")] = {
                "params": r.data.params,
                "metrics": metrics,
                "status": r.info.status,
                "parent": name_of.get(r.data.tags.get("mlflow.parentRunId")),
                "start": r.info.start_time,
                "end": r.info.end_time,
                "tags": {
                    k: v
                    for k, v in r.data.tags.items()
                    if k.startswith(("sweep.", "best.", "resume", "run_dir", "model."))
                    and k not in ("best.run_id",)
                },
            }
        return out_

    live = index(f"sqlite:///{out}/mlflow.db")
    (out / "mlflow.db").unlink()
    shutil.rmtree(out / "mlartifacts")
    rebuilt = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out)],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert index(f"sqlite:///{out}/mlflow.db") == live
    again = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out)],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert "0 changed, 0 errors" in again.stdout, again.stdout
    time.sleep(0)
