"""The live index is the rebuilt index: after a preempted and resumed run, a preempted and finished sweep and
an Optuna sweep run three times, `reindex --rebuild` makes a DB that holds, field by field, what the live one does."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, Proc, env_for_subprocess, run_pipeline, wait_until
from index_compare import same_index, snapshot

from pipeline.run.directory import RunDir
from pipeline.tracking.link import wait_idle
from pipeline.trainer.curves import draw as curves_bytes

pytestmark = pytest.mark.slow


def pipeline(out: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = run_pipeline(
        [
            *args,
            *KERNODECK[:1],
            "tracking=mlflow",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
        ],
        cwd,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert wait_idle(f"sqlite:///{out}/mlflow.db"), (
        "the tracking agent went away before the index was complete"
    )
    return proc


def test_a_rebuilt_index_holds_what_the_live_one_does(tmp_path):
    import optuna

    out, cwd = tmp_path / "out", tmp_path / "cwd"
    uri = f"sqlite:///{out}/mlflow.db"
    long = (
        "trainer.max_steps=400",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=50",
        "trainer.eval_every=50",
    )
    # a run preempted (SIGTERM, paced so it is mid-run), then resumed by the same command
    paced = Proc(
        [
            *KERNODECK[:1],
            "tracking=mlflow",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            *long,
        ],
        cwd,
        env={"PIPELINE_CHAOS_PACE": "0.01"},
    )
    wait_until(
        lambda: any(
            len(RunDir(p.parent).read_metrics()) > 60
            for p in (out / "runs").glob("*/metrics.jsonl")
        ),
        "the paced run past its first checkpoint",
        paced,
    )
    paced.send_signal(signal.SIGTERM)
    assert paced.wait() == 75, paced.stderr[-3000:]
    assert wait_idle(uri)
    pipeline(out, cwd, *long)
    runs_before = {p.name for p in (out / "runs").iterdir()}
    # a grid sweep preempted mid-job (its parent then lists the failure), finished by the identical command
    grid = ("-m", "optimizer.lr=0.01,0.03", *long)
    launcher = Proc(
        [
            *grid,
            *KERNODECK[:1],
            "tracking=mlflow",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
        ],
        cwd,
        env={"PIPELINE_CHAOS_PACE": "0.01"},
    )
    wait_until(
        lambda: any(
            len(RunDir(p.parent).read_metrics()) > 60
            for p in (out / "runs").glob("*/metrics.jsonl")
            if p.parent.name not in runs_before
        ),
        "a sweep job past its first checkpoint",
        launcher,
    )
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait() == 75, launcher.stderr[-3000:]
    assert wait_idle(uri)
    (cut,) = [v for k, v in snapshot(uri).items() if k[0] == "parent"]
    assert cut["status"] == "KILLED" and "preempted" in cut["tags"]["sweep.failures"]
    pipeline(out, cwd, *grid)
    # an Optuna study continued by the same command and by a larger n_trials
    study = (
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_jobs=1",
        "optimizer.lr=tag(log,interval(1e-3,1e-1))",
    )
    pipeline(out, cwd, *study, "hydra.sweeper.n_trials=3")
    optuna_dir = next(p.parent for p in (out / "sweeps").glob("*/optuna.db"))
    jobs_before = {p.name: p.read_bytes() for p in (optuna_dir / "jobs").iterdir()}
    pipeline(
        out, cwd, *study, "hydra.sweeper.n_trials=3"
    )  # the identical command: the study is complete
    assert {p.name: p.read_bytes() for p in (optuna_dir / "jobs").iterdir()} == jobs_before
    pipeline(out, cwd, *study, "hydra.sweeper.n_trials=5")  # two more trials of the same study
    assert len(list((out / "sweeps").iterdir())) == 2
    assert sorted(p.name for p in (optuna_dir / "jobs").iterdir()) == [
        f"{n}.json" for n in range(5)
    ]
    trials = optuna.load_study(
        study_name=optuna_dir.name.rsplit("-", 1)[1], storage=f"sqlite:///{optuna_dir}/optuna.db"
    ).trials
    assert [t.number for t in trials] == list(range(5)) and all(
        t.state.name == "COMPLETE" for t in trials
    )

    live = snapshot(uri)
    parents = [v for k, v in live.items() if k[0] == "parent"]
    assert sorted(p["tags"]["sweep.jobs"] for p in parents) == ["2", "5"]
    assert all(
        p["tags"]["sweep.failed"] == "0" and "sweep.failures" not in p["tags"] for p in parents
    )
    assert all(p["tags"].get("git_sha") for p in parents)
    optuna_children = [
        v for v in live.values() if v["parent"] == ("parent", optuna_dir.name.rsplit("-", 1)[1])
    ]
    assert sorted(c["tags"]["sweep.job_num"] for c in optuna_children) == [str(n) for n in range(5)]
    resumed = {k: v for k, v in live.items() if k[0] == "run" and v["tags"].get("resumes") == "1"}
    assert len(resumed) >= 2 and all(
        len(v["metrics"]["train/loss"]) == 400 for v in resumed.values()
    )
    for (
        _,
        run_dir,
    ), v in resumed.items():  # the curve of the whole run, not the one drawn at the preemption
        assert v["artifacts"]["curves.png"] == curves_bytes(RunDir(Path(run_dir)).read_metrics())
    grid_sweep = next(p for p in (out / "sweeps").iterdir() if p != optuna_dir)
    first_start = json.loads((grid_sweep / "sweep.json").read_text())["started"]
    assert live[("parent", grid_sweep.name.rsplit("-", 1)[1])]["start"] == int(first_start * 1000)
    shutil.copy(out / "mlflow.db", tmp_path / "live.db")

    rebuilt = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out), "--rebuild"],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    same_index(live, snapshot(uri))


def test_a_resume_that_drops_a_machine_key_leaves_no_tag_of_it(tmp_path):
    """A first process under a time budget (exit 75) and a resume without one: the live index says the run as the
    resume ended it (no `config.trainer.max_time`, no `config.trainer.threads`), as a rebuild from disk does."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    uri = f"sqlite:///{out}/mlflow.db"
    long = (
        "trainer.max_steps=400",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=50",
        "trainer.eval_every=50",
    )
    budget = Proc(
        [
            *KERNODECK[:1],
            "tracking=mlflow",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            *long,
            "trainer.max_time=00:00:00:02",
            "trainer.threads=1",
        ],
        cwd,
        env={"PIPELINE_CHAOS_PACE": "0.01"},
    )
    assert budget.wait() == 75, budget.stderr[-3000:]
    assert wait_idle(uri)
    (first,) = snapshot(uri).values()
    assert first["status"] == "KILLED" and first["tags"]["config.trainer.max_time"] == "00:00:00:02"
    assert first["tags"]["config.trainer.threads"] == "1"
    pipeline(out, cwd, *long)
    live = snapshot(uri)
    (run,) = live.values()
    assert run["status"] == "FINISHED" and run["tags"]["resumes"] == "1"
    assert not {"config.trainer.max_time", "config.trainer.threads"} & set(run["tags"]), run["tags"]

    rebuilt = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out), "--rebuild"],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    same_index(live, snapshot(uri))


def test_a_sweep_whose_jobs_die_before_recording_themselves_keeps_its_first_start_in_a_rebuild_elsewhere(
    tmp_path,
):
    """A joblib sweep whose jobs are killed before any has recorded itself (the launcher's error path, after it
    asked for the parent run), then finished by the identical command: sweep.json keeps the first start, the live
    parent holds it, and `reindex --tracking-uri` into another store builds the same index, that start included."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    uri = f"sqlite:///{out}/mlflow.db"
    pipeline(
        out, cwd, "trainer.max_steps=5", "optimizer.lr=0.1"
    )  # the agent warm: it makes the parent at once
    grid = (
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "optimizer.lr=0.01,0.03",
        "trainer.max_steps=30",
    )
    killed = Proc(
        [
            *grid,
            *KERNODECK[:1],
            "tracking=mlflow",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
        ],
        cwd,
        env={"PIPELINE_CHAOS": "setup:1"},
    )  # each job SIGKILLed as its run's setup begins
    assert killed.wait() != 0, killed.stderr[-3000:]
    assert wait_idle(uri)
    records = list((out / "sweeps").glob("*/sweep.json"))
    assert len(records) == 1, (
        "the sweep's record is gone, and its first start with it (the index holds its parent)"
    )
    sweep_json = records[0]
    first = json.loads(sweep_json.read_text())
    jobs = sweep_json.parent / "jobs"
    assert not (jobs.exists() and any(jobs.iterdir())) and first["status"] == "failed", first
    (cut,) = [v for k, v in snapshot(uri).items() if k[0] == "parent"]
    assert cut["start"] == int(first["started"] * 1000)
    pipeline(out, cwd, *grid)
    assert json.loads(sweep_json.read_text())["started"] == first["started"]

    live = snapshot(uri)
    (parent,) = [v for k, v in live.items() if k[0] == "parent"]
    assert parent["start"] == int(first["started"] * 1000) and parent["status"] == "FINISHED"
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    rebuilt = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out), "--tracking-uri", elsewhere],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    same_index(live, snapshot(elsewhere))
