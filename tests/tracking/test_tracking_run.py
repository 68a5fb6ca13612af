"""One tracked job end to end against a real sqlite mlflow store: what is logged, resume, failure, reindex.

Every run is `python -m pipeline experiment=kernodeck paths.output_dir=<tmp>` in a subprocess. The module's
main fixture is one run preempted with SIGTERM and resumed, so one pair of processes covers the logged
params, tags, metric points and artifacts and the run's continuity across a resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.tracking.common import params_of, parse_run_uri

PROJECT_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 3000


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def premigrated_db(tmp_path_factory) -> Path:
    """A migrated, empty mlflow DB made once per session: copied in, it spares each test the 3-6 s migration."""
    path = tmp_path_factory.getbasetemp() / "mlflow-template-run.db"
    if not path.exists():
        from mlflow import MlflowClient

        MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def client_for(out: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{out}/mlflow.db")


def all_runs(client):
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, max_results=1000)


def artifact_files(client, run_id, path=None) -> dict[str, int]:
    out = {}
    for a in client.list_artifacts(run_id, path):
        out.update(artifact_files(client, run_id, a.path) if a.is_dir else {a.path: a.file_size})
    return out


def local_artifacts(run) -> Path:
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(run.info.artifact_uri).path))


def manifests(run_dir: Path) -> dict[int, dict]:
    return {
        int(p.parent.name[5:]): json.loads(p.read_text())
        for p in sorted((run_dir / "checkpoints").glob("step-*/manifest.json"))
    }


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, pipeline_runner):
    """kernodeck for STEPS steps (a checkpoint every 250), tracked into sqlite; SIGTERM once metrics flow
    (exit 75), then the same command again (resumes and completes)."""
    root = tmp_path_factory.mktemp("tracked")
    out, cwd = root / "out", root / "cwd"
    out.mkdir()
    cwd.mkdir()
    shutil.copy(premigrated_db(tmp_path_factory), out / "mlflow.db")
    args = [
        "experiment=kernodeck",
        f"paths.output_dir={out}",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every=10",
        "trainer.progress_bar=false",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=250",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((out / "runs").glob("*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 20:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    first_out, first_err = proc.communicate()
    run_dir = next((out / "runs").iterdir())
    first_manifests = manifests(run_dir)
    second = pipeline_runner(args, cwd=cwd)
    from pipeline.tracking.link import wait_idle

    assert wait_idle(
        f"sqlite:///{out}/mlflow.db"
    )  # the agent completes the index after the job has gone
    return SimpleNamespace(
        out=out,
        run_dir=run_dir,
        first_rc=proc.returncode,
        first_err=first_out + first_err,
        first_manifests=first_manifests,
        second=second,
    )


@pytest.fixture(scope="module")
def tracked(resumed):
    assert resumed.first_rc == 75, resumed.first_err[-3000:]
    assert resumed.second.returncode == 0, resumed.second.stderr[-3000:]
    client = client_for(resumed.out)
    runs = all_runs(client)
    assert len(runs) == 1, [r.data.tags.get("mlflow.runName") for r in runs]
    return SimpleNamespace(client=client, run=runs[0], **vars(resumed))


def test_no_tracking_warning_on_a_healthy_store(tracked):
    for err in (tracked.first_err, tracked.second.stdout + tracked.second.stderr):
        assert "mlflow tracking" not in err and "Traceback" not in err, err[-3000:]


def test_params_are_the_flattened_resolved_config_without_machine_keys(tracked):
    final = manifests(tracked.run_dir)[STEPS]
    assert tracked.run.data.params == params_of(final["config"])
    assert tracked.run.data.params["optimizer.lr"] == "0.03"
    assert not any(
        k.startswith(("paths.", "tracking.", "verify.", "resume.")) for k in tracked.run.data.params
    )
    assert not any(
        k.startswith("config.") and k[len("config.") :] in tracked.run.data.params
        for k in tracked.run.data.tags
    )  # a key is a param or a tag, never both


def test_tags_carry_the_run_facts_and_the_resume(tracked):
    tags, final = tracked.run.data.tags, manifests(tracked.run_dir)[STEPS]
    for key in ("config_hash", "semantic_config_hash", "data_manifest_hash", "git_sha"):
        assert tags[key] == str(final[key]), key
    assert tags["run_dir"] == str(tracked.run_dir.resolve())
    assert tags["experiment"] == "kernodeck"
    assert tags["mlflow.runName"] == tracked.run_dir.name
    preempted_at = max(tracked.first_manifests)
    assert tags["resumes"] == "1" and tags["resume.1"] == str(preempted_at)
    assert tracked.run.info.status == "FINISHED"
    assert tags["model.parameters"] == "33"
    status = json.loads((tracked.run_dir / "run.json").read_text())
    assert tracked.run.info.start_time == int(
        status["started"] * 1000
    )  # the job's true start, not the agent's
    assert tracked.run.info.end_time == int(status["ended_at"] * 1000)
    assert tracked.run.data.metrics["best/val/loss"] == min(
        ln["val/loss"] for ln in metric_lines(tracked.run_dir) if "val/loss" in ln
    )


def test_every_metric_point_of_metrics_jsonl_once_with_its_step_and_time(tracked):
    lines = metric_lines(tracked.run_dir)
    keys = {k for line in lines for k in line} - {"step", "epoch", "time"}
    assert {"train/loss", "lr", "grad_norm", "val/loss"} <= keys
    for key in keys:
        expected = [(ln["step"], ln[key], int(ln["time"] * 1000)) for ln in lines if key in ln]
        history = sorted(
            (m.step, m.value, m.timestamp)
            for m in tracked.client.get_metric_history(tracked.run.info.run_id, key)
        )
        assert history == expected, key  # continuous across the resume, nothing twice
    assert len([ln for ln in lines if "train/loss" in ln]) == len(lines) >= 500


def test_artifacts_manifests_final_weights_and_curves(tracked):
    files = artifact_files(tracked.client, tracked.run.info.run_id)
    on_disk = manifests(tracked.run_dir)
    for step in on_disk:
        assert f"checkpoints/step-{step:08d}/manifest.json" in files, step
    for step in set(tracked.first_manifests) - set(
        on_disk
    ):  # retired since: gone from disk, gone from the index
        assert f"checkpoints/step-{step:08d}/manifest.json" not in files, step
    root = local_artifacts(tracked.run)
    weights = (root / "final/weights.safetensors").read_bytes()
    assert (
        hashlib.sha256(weights).hexdigest()
        == on_disk[STEPS]["files"]["weights.safetensors"]["sha256"]
    )
    assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "hydra/config.yaml").read_bytes() == (
        tracked.run_dir / ".hydra/config.yaml"
    ).read_bytes()
    assert (root / "pipeline.log").read_bytes() == (tracked.run_dir / "pipeline.log").read_bytes()
    for step in on_disk:  # the bytes on disk, not a re-serialisation
        name = f"checkpoints/step-{step:08d}/manifest.json"
        assert (root / name).read_bytes() == (tracked.run_dir / name).read_bytes()
    assert str(root).startswith(str(tracked.out / "mlartifacts" / "kernodeck"))


def test_manifests_and_run_json_name_the_run_and_the_resumed_job_continued_it(tracked):
    """A manifest saved before its job knew the run's URI says null (the job does not wait for a cold agent);
    every other names the one run, the resumed job's included, and run.json names it once the agent has."""
    rid = tracked.run.info.run_id
    named = [
        m["mlflow_run_uri"]
        for m in [*tracked.first_manifests.values(), *manifests(tracked.run_dir).values()]
    ]
    assert {parse_run_uri(u)[2] for u in named if u is not None} <= {rid}
    base, experiment_id, run_id = parse_run_uri(
        json.loads((tracked.run_dir / "run.json").read_text())["mlflow_run_uri"]
    )
    assert (base, experiment_id, run_id) == (
        f"sqlite:///{tracked.out}/mlflow.db",
        tracked.run.info.experiment_id,
        rid,
    )


def test_reindex_of_a_complete_index_adds_nothing(tracked):
    from pipeline.cli.reindex import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([str(tracked.out)]) == 0
    assert "up to date" in buf.getvalue() and "0 changed, 0 errors" in buf.getvalue(), (
        buf.getvalue()
    )


def test_unwritable_store_warns_once_training_completes_and_reindex_rebuilds_idempotently(
    tmp_path, tmp_path_factory, pipeline_runner
):
    out = tmp_path / "out"
    proc = pipeline_runner(
        [
            "experiment=kernodeck",
            f"paths.output_dir={out}",
            "tracking.uri=sqlite:////proc/nonexistent/x.db",
        ],
        cwd=tmp_path / "cwd",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert log.count("mlflow tracking (sqlite:////proc/nonexistent/x.db) is off") == 1, log[-3000:]
    run_dir = next((out / "runs").iterdir())
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    written = manifests(run_dir)
    assert written and all(m["mlflow_run_uri"] is None for m in written.values())

    shutil.copy(
        premigrated_db(tmp_path_factory), out / "mlflow.db"
    )  # spares the migration, not the indexing
    first = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "created" in first.stdout and "1 changed, 0 errors" in first.stdout, first.stdout
    client = client_for(out)
    (run,) = all_runs(client)
    assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(run_dir.resolve())
    assert run.data.params == params_of(written[max(written)]["config"])
    assert (
        len(client.get_metric_history(run.info.run_id, "train/loss"))
        == len(metric_lines(run_dir))
        == 10
    )
    files = artifact_files(client, run.info.run_id)
    assert {
        "curves.png",
        "final/weights.safetensors",
        *(f"checkpoints/step-{s:08d}/manifest.json" for s in written),
    } <= set(files)

    from pipeline.cli.reindex import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([str(out)]) == 0
    assert "0 changed, 0 errors" in buf.getvalue(), buf.getvalue()
    (again,) = all_runs(client)
    assert again.info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 10
    assert artifact_files(client, run.info.run_id) == files


def test_tracking_server_down_warns_and_training_completes(tmp_path, pipeline_runner):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    proc = pipeline_runner(
        [
            "experiment=kernodeck",
            f"paths.output_dir={tmp_path / 'out'}",
            "tracking=server",
            f"tracking.uri=http://127.0.0.1:{port}",
        ],
        cwd=tmp_path / "cwd",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert log.count(f"mlflow tracking (http://127.0.0.1:{port}) is off") == 1, log[-3000:]
    run_dir = next((tmp_path / "out" / "runs").iterdir())
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
