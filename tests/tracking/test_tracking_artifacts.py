"""What a person sees of the index: artifacts where the tracking URI's server keeps them, params free of
machine paths, experiments marked as machine learning for mlflow 3's UI, and the table a sweep ends with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, SHARED_SERVER, env_for_subprocess

from pipeline.sweep.summary import MAX_ROWS, best_job, read_jobs, sweep_table
from pipeline.tracking.common import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MACHINE_TAGS,
    artifact_root,
    is_machine_key,
    params_of,
    tags_of,
)


# --- where artifacts go
def test_a_tracking_server_chooses_where_artifacts_go_and_a_local_store_keeps_them_by_its_db(
    tmp_path,
):
    for server in ("http://127.0.0.1:5000", "https://mlflow.example", "databricks"):
        assert artifact_root(server, str(tmp_path / "mlartifacts")) is None
        assert artifact_root(server) is None
    db = f"sqlite:///{tmp_path}/mlflow.db"
    assert artifact_root(db) == (tmp_path / "mlartifacts").as_uri()
    assert artifact_root(db, str(tmp_path / "elsewhere")) == (tmp_path / "elsewhere").as_uri()
    assert artifact_root(db, "s3://bucket/root") == "s3://bucket/root"
    assert (
        artifact_root("postgresql+psycopg2://h/db", str(tmp_path / "a"))
        == (tmp_path / "a").as_uri()
    )


# --- params and tags
def test_no_machine_path_in_params_and_no_tag_duplicates_a_param(compose_cfg, tmp_path):
    from pipeline.config.compose import to_plain

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the old man and the sea\n" * 20)
    source = tmp_path / "some" / "checkpoint"
    config = to_plain(
        compose_cfg(
            "data=text",
            f"data.path={corpus}",
            f"paths.output_dir={tmp_path / 'out'}",
            f"resume.source={source}",
            "trainer.threads=1",
        )
    )
    params = params_of(config)
    for key, value in params.items():
        assert not is_machine_key(key), key
        assert str(tmp_path) not in value, (key, value)  # no path of this machine in a comparison
    for key in (
        "resume.source",
        "stages.resume.source",
        "paths.output_dir",
        "data.path",
        "tracking.uri",
    ):
        assert key not in params, key
    tags = tags_of({"config": config}, tmp_path / "run")
    config_tags = {k[len("config.") :] for k in tags if k.startswith("config.")}
    assert config_tags == {
        "resume.source",
        "data.path",
        "trainer.threads",
    }  # the few worth one, when set
    assert config_tags <= set(MACHINE_TAGS) and not config_tags & set(params)
    assert tags["config.resume.source"] == str(source) and tags["config.data.path"] == str(corpus)


# --- the experiment's kind
def test_experiments_are_marked_machine_learning_when_created_or_found_unmarked(tmp_path):
    from mlflow import MlflowClient

    from pipeline.tracking import store

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client, _ = store.open_store(uri, str(tmp_path / "mlartifacts"))
    made = store.ensure_experiment(client, "made", str(tmp_path / "mlartifacts"))
    exp = MlflowClient(uri).get_experiment(made)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert exp.artifact_location == (tmp_path / "mlartifacts" / "made").as_uri()
    bare = client.create_experiment("by-hand")  # made by another tool, unmarked
    assert EXPERIMENT_KIND_TAG not in MlflowClient(uri).get_experiment(bare).tags
    assert store.ensure_experiment(client, "by-hand", None) == bare
    assert MlflowClient(uri).get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    client.set_experiment_tag(
        bare, EXPERIMENT_KIND_TAG, "genai_development"
    )  # a person's choice stays
    store.ensure_experiment(client, "by-hand", None)
    assert MlflowClient(uri).get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == "genai_development"


# --- the sweep's table (pure)
def _jobs(values: dict[int, object], statuses: dict[int, str] | None = None) -> dict[int, dict]:
    statuses = statuses or {}
    return {
        n: {
            "num": n,
            "name": f"optimizer.lr={n}",
            "overrides": ["experiment=kernodeck", f"optimizer.lr={n}"],
            "objective": v,
            "status": statuses.get(n, "complete"),
            "run_dir": f"/r/{n}",
        }
        for n, v in values.items()
    }


SWEEP = {
    "id": "0123456789ab",
    "name": "kernodeck",
    "swept": {"optimizer.lr": "0,1,2"},
    "dir": "/o/sweeps/s",
    "objective": "best/val/loss",
    "direction": "minimize",
}


def _marked(lines: list[str]) -> list[int]:
    """The job numbers of the rows marked as the winner."""
    return [int(line.split()[1]) for line in lines if line.startswith("  * ")]


def test_the_table_marks_the_winner_of_the_records_in_either_direction():
    jobs = _jobs({0: 0.5, 1: 0.2, 2: "NaN", 3: None}, {2: "failed", 3: "preempted"})
    lines = sweep_table(SWEEP, jobs, best_job(jobs, SWEEP), ["not tracked (tracking=none)"])
    assert (
        lines[0]
        == "sweep kernodeck-0123456789ab: 4 jobs (2 complete, 1 failed, 1 preempted), best/val/loss (min)"
    )
    assert lines[1].split() == ["job", "optimizer.lr", "best/val/loss", "status"]
    rows = [line.split() for line in lines[2:6]]
    assert [r[-3:] for r in rows] == [
        ["0", "0.5", "complete"],
        ["1", "0.2", "complete"],
        ["2", "-", "failed"],
        ["3", "-", "preempted"],
    ]
    assert _marked(lines) == [1] and lines[-2] == "best: job 1 (optimizer.lr=1) /r/1"
    assert lines[-1] == "parent: not tracked (tracking=none)"
    maximize = {**SWEEP, "direction": "maximize"}
    assert _marked(sweep_table(maximize, jobs, best_job(jobs, maximize), ["x"])) == [0]


def test_a_big_sweep_shows_its_best_jobs_and_how_many_more():
    jobs = _jobs({n: (n * 7) % 101 if n % 9 else None for n in range(250)})
    lines = sweep_table(SWEEP, jobs, best_job(jobs, SWEEP), ["p", "its runs: q"])
    assert len(lines) < 20
    shown = [int(line.split()[-4]) for line in lines[2 : 2 + MAX_ROWS]]
    scored = sorted((j["objective"], n) for n, j in jobs.items() if j["objective"] is not None)
    assert shown == [n for _, n in scored[:MAX_ROWS]]  # the best first
    assert _marked(lines) == [scored[0][1]]
    assert (
        f"... {250 - MAX_ROWS} more jobs" in lines[2 + MAX_ROWS]
        and "/o/sweeps/s/jobs/" in lines[2 + MAX_ROWS]
    )


# --- end to end: a sweep's table on the console
def _sweep(
    out: Path, cwd: Path, *overrides: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "-m",
            "experiment=kernodeck",
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            *overrides,
        ],
        cwd=cwd,
        env=env or env_for_subprocess(),
        capture_output=True,
        text=True,
    )


def _table_of(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("sweep kernodeck-"))
    return lines[start:]


def _check_table(table: list[str], out: Path) -> dict:
    """The table names every job of the sweep directory's records and marks the one best_job picks."""
    (sweep_dir,) = (out / "sweeps").iterdir()
    jobs = read_jobs(sweep_dir)
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert len(jobs) == 3 and all(j["status"] == "complete" for j in jobs.values())
    assert table[0] == f"sweep kernodeck-{sweep['id']}: 3 jobs (3 complete), best/val/loss (min)"
    rows = {int(line.split()[-4]): line for line in table[2:5]}
    assert sorted(rows) == [0, 1, 2]
    for n, job in jobs.items():
        assert (
            f"{job['objective']:.6g}" in rows[n].split()
            and job["overrides"][-1].split("=")[1] in rows[n]
        )
    best = best_job(jobs, sweep)
    assert _marked(table) == [best["num"]]
    return {"sweep": sweep, "best": best}


@pytest.mark.slow
def test_a_sweep_without_tracking_ends_with_its_table(tmp_path):
    out = tmp_path / "out"
    proc = _sweep(out, tmp_path / "cwd", "tracking=none", "optimizer.lr=0.01,0.03,0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table_of(proc.stderr)
    _check_table(table, out)
    assert table[-1] == "parent: not tracked (tracking=none)"
    assert len(table) == 7


# --- end to end: a real tracking server that keeps the artifacts
@pytest.fixture
def artifact_server(shared_mlflow_server):
    """The shared `mlflow server`, serving artifacts from its own --artifacts-destination."""
    return shared_mlflow_server


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


@pytest.mark.slow
@SHARED_SERVER
def test_mlflow_tracking_uri_of_a_server_keeps_every_artifact_on_the_server(
    tmp_path, artifact_server
):
    from mlflow import MlflowClient

    from pipeline.tracking.link import wait_idle

    uri, destination = artifact_server
    out = tmp_path / "out"
    env = {**env_for_subprocess(), "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "served"}
    proc = _sweep(
        out, tmp_path / "cwd", "optimizer.lr=0.01,0.03,0.1", env=env
    )  # tracking=mlflow, the default
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            *KERNODECK[:1],
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            "model.hidden=[4]",
        ],
        cwd=tmp_path / "cwd",
        env=env,
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert wait_idle(uri)  # the agent completes the index after the processes have gone

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("served")
    assert exp.artifact_location.startswith("mlflow-artifacts:/"), exp.artifact_location
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    singles = [r for r in runs if r not in parents and r not in children]
    assert len(parents) == 1 and len(children) == 3 and len(singles) == 1
    for run in runs:
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
        assert {a.path for a in client.list_artifacts(run.info.run_id)}, run.data.tags.get(
            "mlflow.runName"
        )
    for run in [*children, *singles]:
        assert {"curves.png", "final", "checkpoints", "hydra"} <= {
            a.path for a in client.list_artifacts(run.info.run_id)
        }
    served = _files(destination)
    assert any(p.name == "weights.safetensors" for p in served) and any(
        p.name == "multirun.yaml" for p in served
    )
    assert (
        _files(out / "mlartifacts") == [] and not (out / "mlflow.db").exists()
    )  # nothing on the client's side

    table = _table_of(proc.stderr)
    checked = _check_table(table, out)
    (parent,) = parents
    sweep_id = checked["sweep"]["id"]
    assert parent.data.tags["sweep.id"] == sweep_id
    if table[-1].startswith(
        "parent: sweep.id="
    ):  # the agent had not answered yet (the launcher never waits)
        assert table[-1] == (
            f"parent: sweep.id={sweep_id} in {uri} (the tracking agent completes it after this "
            "process exits)"
        )
    else:
        assert table[-2] == (
            f"parent: {uri}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
            "?workflowType=machine_learning"
        )
        assert (
            table[-1]
            == f"its runs: {uri}/#/experiments/{exp.experiment_id}?workflowType=machine_learning"
        )
    assert parent.data.tags["best.job"] == str(
        checked["best"]["num"]
    )  # the table and the parent agree
