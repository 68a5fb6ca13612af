"""A job never waits on the index beyond tracking.wait, and the index still ends complete after it has gone;
a fresh store is a copy of one migrated template, never put over an existing DB.

The slow agent is the real agent made slow to start (PIPELINE_TRACKING_AGENT_DELAY): the jobs end long
before it can open the store, so they must hand over and leave; the job logs how long it waited in all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import KERNODECK, env_for_subprocess, wait_until

from pipeline.run.directory import RunDir
from pipeline.tracking.common import parse_run_uri
from pipeline.tracking.link import wait_idle

SLOW = (
    20.0  # seconds the slow agent sleeps before importing mlflow: far longer than a kernodeck job
)
WAITED = re.compile(r"mlflow: this job waited ([0-9.]+) s on tracking in all \(bound ([0-9.]+) s\)")


# --- the tracker's bound, with a link that never answers
class SilentLink:
    """An agent that takes everything and answers nothing; its socket writes take `stall` seconds."""

    def __init__(self, stall: float = 0.0):
        self.sent, self.stall, self.ids = [], stall, 0

    def register(self, handler) -> int:
        self.ids += 1
        if self.ids == 1:
            handler.on_event(
                {"event": "pong"}
            )  # warm: the tracker will wait for the URI (within its bound)
        return self.ids

    def send(self, msg) -> None:
        self.sent.append(msg)

    def drain(self, timeout: float) -> bool:
        return threading.Event().wait(min(timeout, self.stall)) or self.stall <= timeout


@pytest.mark.parametrize("stall", [0.0, 5.0])
def test_a_job_waits_at_most_its_bound_in_all_for_an_agent_that_never_answers(
    monkeypatch, tmp_path, stall
):
    import pipeline.tracking.link as link
    from pipeline.tracking.mlflow_tracker import MlflowTracker

    silent = SilentLink(stall)
    monkeypatch.setattr(link, "agent_for", lambda *args: silent)
    t = MlflowTracker(
        uri=f"sqlite:///{tmp_path}/m.db", experiment="e", artifact_location=None, wait=0.4
    )
    t.prepare()
    t.start(config={"name": "e"}, facts={}, run_dir=tmp_path, previous_run_uri=None)
    assert t.run_uri(timeout=30.0) is None  # what Run.checkpoint asks at the final save
    assert t.run_uri(timeout=30.0) is None
    t.finish("FINISHED", tmp_path)
    assert [m["op"] for m in silent.sent] == ["ping", "open", "finish"]  # handed over all the same
    assert (
        0.2 <= t.waited <= 0.4 + 0.05
    )  # half the bound for the URI, the rest (at most) for the hand-over


# --- the real agent, made slow
def slow_env() -> dict:
    return {
        **env_for_subprocess(),
        "PIPELINE_TRACKING_AGENT_DELAY": str(SLOW),
        "PIPELINE_TRACKING_AGENT_IDLE": "3",
    }


def waits_in(log: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in WAITED.findall(log)]


def runs_of(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client, client.search_runs(
        [e.experiment_id for e in client.search_experiments()], max_results=100
    )


def check_complete(client, run, run_dir: Path) -> None:
    """Ended, every metrics.jsonl point, its log as on disk, and the two links: run.json -> run -> run_dir."""
    assert run.info.status == "FINISHED"
    rundir = RunDir(run_dir)
    lines = rundir.read_metrics()
    for key in ("train/loss", "lr"):
        assert sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
        ) == [(ln["step"], ln[key]) for ln in lines], key
    assert run.data.tags["run_dir"] == str(run_dir.resolve())
    assert parse_run_uri(rundir.read_status()["mlflow_run_uri"])[2] == run.info.run_id
    local = Path(
        client.download_artifacts(
            run.info.run_id, "pipeline.log", str(run_dir.parent.parent / "dl")
        )
    )
    assert (
        local.read_bytes() == rundir.log_path.read_bytes()
    )  # indexed after the job had written its last line


@pytest.mark.slow
def test_a_job_hands_over_to_a_slow_agent_and_the_index_completes_after_it(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            *KERNODECK[:1],
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
        ],
        cwd=tmp_path / "cwd",
        env=slow_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((out / "runs").iterdir())
    ((waited, bound),) = waits_in(RunDir(run_dir).log_path.read_text())
    assert bound == 1.0 and waited <= bound, waited
    assert "mlflow tracking" not in proc.stdout + proc.stderr  # nothing failed: it is only late
    manifests = [
        json.loads(p.read_text()) for p in (run_dir / "checkpoints").glob("step-*/manifest.json")
    ]
    assert manifests and all(
        m["mlflow_run_uri"] is None for m in manifests
    )  # saved before the URI existed

    uri = f"sqlite:///{out}/mlflow.db"
    assert wait_idle(uri)
    client, runs = runs_of(uri)
    (run,) = runs
    check_complete(client, run, run_dir)
    again = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out)],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert "0 changed, 0 errors" in again.stdout, (
        again.stdout + again.stderr
    )  # nothing was left for it


@pytest.mark.slow
def test_a_sweep_hands_over_to_a_slow_agent_and_its_family_completes_after_it(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "-m",
            *KERNODECK[:1],
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            "optimizer.lr=0.01,0.03",
        ],
        cwd=tmp_path / "cwd",
        env=slow_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "completes the sweep's parent run after this process exits" in proc.stdout + proc.stderr
    run_dirs = sorted((out / "runs").iterdir())
    waits = [w for d in run_dirs for w in waits_in(RunDir(d).log_path.read_text())]
    assert len(waits) == 2 and all(waited <= bound == 1.0 for waited, bound in waits), waits

    uri = f"sqlite:///{out}/mlflow.db"
    assert wait_idle(uri)
    client, runs = runs_of(uri)
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = {
        r.data.tags["run_dir"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert parent.info.status == "FINISHED" and sorted(children) == [
        str(d.resolve()) for d in run_dirs
    ]
    for d in run_dirs:
        check_complete(client, children[str(d.resolve())], d)
    best = min(children.values(), key=lambda c: c.data.metrics["best/val/loss"])
    assert (
        parent.data.tags["best.run_id"] == best.info.run_id
    )  # found by its run_dir: its job never knew it


# --- the migrated template
def open_store(uri: str, root: str) -> str:
    return (
        f"import json, sys; from pipeline.tracking import store; c, _ = store.open_store({uri!r}, {root!r}); "
        "print(json.dumps([[e.experiment_id, e.name, e.artifact_location] for e in c.search_experiments()]))"
    )


@pytest.mark.slow
def test_two_processes_racing_on_a_fresh_directory_make_one_db_from_the_template(tmp_path):
    out = tmp_path / "out"
    uri, root = f"sqlite:///{out}/mlflow.db", str(out / "mlartifacts")
    env = {
        **env_for_subprocess(),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }  # no template yet: one is made
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", open_store(uri, root)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate() for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
        for bad in ("already exists", "duplicate column", "OperationalError", "Traceback"):
            assert bad not in stderr, stderr[-3000:]
        assert json.loads(stdout) == [["0", "Default", f"file://{out}/mlartifacts/0"]]
    assert sorted(p.name for p in out.iterdir()) == ["mlflow.db"]  # one DB, no temporary file left
    (template,) = (tmp_path / "cache" / "pipeline").glob("mlflow-*-empty.db")
    assert template.stat().st_size > 0


@pytest.mark.slow
def test_the_template_is_copied_not_migrated_and_never_over_an_existing_db(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    import mlflow.store.db.utils as db_utils

    from pipeline.tracking import store

    assert store.template_db() is not None
    calls = []
    real = db_utils._initialize_tables
    monkeypatch.setattr(
        db_utils, "_initialize_tables", lambda engine: calls.append(engine) or real(engine)
    )
    uri = f"sqlite:///{tmp_path}/a/mlflow.db"
    client, _ = store.open_store(uri, str(tmp_path / "a" / "art"))
    assert calls == []  # a copy of the template: no migration ran
    exp = client.create_experiment("kept")
    run = client.create_run(exp)
    before = (tmp_path / "a" / "mlflow.db").read_bytes()
    store._copy_template(tmp_path / "a" / "mlflow.db")  # as a racing process would
    assert (tmp_path / "a" / "mlflow.db").read_bytes() == before
    again, _ = store.open_store(uri, str(tmp_path / "a" / "art"))
    assert again.get_run(run.info.run_id).info.experiment_id == exp
    assert [e.artifact_location for e in again.search_experiments() if e.name == "Default"] == [
        f"file://{tmp_path}/a/art/0"
    ]


def test_an_agent_that_cannot_start_is_one_warning_and_no_wait(monkeypatch, caplog, tmp_path):
    """The link connects (or spawns) in its own thread: the failure reaches the tracker as an event."""
    import pipeline.tracking.link as link
    from pipeline.tracking.mlflow_tracker import MlflowTracker

    def cannot(*args):
        raise OSError("cannot start a process here")

    monkeypatch.setattr(link, "spawn", cannot)
    monkeypatch.setattr(link, "_LINKS", {})
    t = MlflowTracker(
        uri=f"sqlite:///{tmp_path}/m.db", experiment="e", artifact_location=None, wait=1.0
    )
    t.prepare()
    # before the run starts: it must still hear
    wait_until(lambda: t.link.dead is not None, "the link to give up")
    t.start(config={"name": "e"}, facts={}, run_dir=tmp_path, previous_run_uri=None)
    assert t.ready.is_set() and t.failed  # set by the error event, not by a timeout
    t.log_line({"step": 1, "epoch": 0, "time": 0.0, "train/loss": 1.0})
    assert t.run_uri(timeout=30.0) is None
    t.finish("FINISHED", tmp_path)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cannot start a process here" in warnings[0].getMessage()
    assert t.waited <= t.wait
