"""`reindex` into a store that is not the run's own: a run id its files name is a hint, never a licence to write
into someone else's run; the run directory is read, never changed; and its output is its own lines only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, SHARED_SERVER, env_for_subprocess, the_run, tree

from pipeline.tracking.common import default_uri, parse_run_uri, run_uri


def reindex(*args: str) -> None:
    from pipeline.cli.reindex import main

    assert main(list(args)) == 0


def state(client, run_id: str) -> dict:
    """Everything a person sees of one run: its name, status, times, params, tags, metric histories, artifacts."""
    run = client.get_run(run_id)
    return {
        "info": (
            run.info.run_name,
            run.info.status,
            run.info.start_time,
            run.info.end_time,
            run.info.lifecycle_stage,
            run.info.experiment_id,
        ),
        "params": run.data.params,
        "tags": run.data.tags,
        "metrics": {
            k: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, k))
            for k in run.data.metrics
        },
        "artifacts": [a.path for a in client.list_artifacts(run_id)],
    }


def runs_tagged(client, run_dir: Path) -> list:
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, f"tags.run_dir = '{run_dir.resolve()}'")


@pytest.mark.parametrize("named_as", ["run_uri", "bare id"])
def test_a_run_id_a_copied_in_manifest_names_is_someone_elses_run_left_untouched(
    tmp_path, finished_job, named_as
):
    from mlflow import MlflowClient

    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    run_dir = the_run(out)
    target = f"sqlite:///{tmp_path / 'team.db'}"
    client = MlflowClient(target)
    # a colleague's run in the same store: one param, one metric, tags of its own, no run_dir tag
    experiment_id = client.create_experiment("colleague")
    theirs = client.create_run(
        experiment_id, tags={"owner": "them"}, run_name="their-run"
    ).info.run_id
    client.log_param(theirs, "lr", "0.1")
    client.log_metric(theirs, "loss", 1.5, step=3)
    client.set_terminated(theirs, "FINISHED")
    before = state(client, theirs)
    # our run, copied in: its manifests name that run (mlflow_run_uri: a field no checksum covers)
    named = run_uri(target, experiment_id, theirs) if named_as == "run_uri" else theirs
    for path in sorted(run_dir.glob("checkpoints/step-*/manifest.json")):
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "mlflow_run_uri": named}, indent=2))

    reindex(str(out), "--tracking-uri", target)
    assert state(client, theirs) == before
    (ours,) = [r for r in runs_tagged(client, run_dir) if r.info.lifecycle_stage == "active"]
    assert ours.info.run_id != theirs and ours.data.params and "train/loss" in ours.data.metrics


def test_a_rebuild_into_another_store_leaves_the_run_directory_as_it_was(tmp_path, finished_job):
    from mlflow import MlflowClient

    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    run_dir = the_run(out)
    reindex(str(out))  # its own store, the output directory's: run.json names the run there
    own = parse_run_uri(json.loads((run_dir / "run.json").read_text())["mlflow_run_uri"])
    assert own[0] == default_uri(out)
    before = tree(out / "runs", mtimes="all")

    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    reindex(str(out), "--tracking-uri", elsewhere)
    assert tree(out / "runs", mtimes="all") == before
    (there,) = runs_tagged(MlflowClient(elsewhere), run_dir)  # indexed there all the same
    assert there.info.status == "FINISHED" and there.info.run_id != own[2]
    reindex(str(out))  # and its own store still finds it by what run.json names: nothing to change
    assert tree(out / "runs", mtimes="all") == before


@pytest.mark.slow
@SHARED_SERVER
def test_reindex_into_a_server_prints_its_own_lines_only(
    tmp_path, finished_job, shared_mlflow_server
):
    """mlflow's download bars (stderr) and "View run" lines (stdout) are off unless the user turns them on."""
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    env = {
        k: v
        for k, v in env_for_subprocess().items()
        if k
        not in ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    }
    for _ in range(
        2
    ):  # created (its status set: "View run"), then compared (small artifacts downloaded)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.reindex",
                str(out),
                "--tracking-uri",
                shared_mlflow_server[0],
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"{the_run(out).name}: "), proc.stdout
        assert lines[1].startswith("reindexed 1 run directories"), proc.stdout
        assert proc.stderr == "", proc.stderr
