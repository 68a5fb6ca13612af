"""Re-running an interrupted -m sweep: finished jobs are skipped, interrupted ones resume, missing ones start."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Proc, env_for_subprocess, run_pipeline, wait_until

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.run.directory import RunDir
from pipeline.run.signals import descendants

SWEEP = [
    "-m",
    "experiment=kernodeck",
    "tracking=none",
    "optimizer.lr=0.01,0.02,0.03",
    "hydra/job_logging=disabled",
]


def sweep(out: Path, chaos: str | None = None) -> subprocess.CompletedProcess:
    env = env_for_subprocess()
    if chaos:
        env["PIPELINE_CHAOS"] = chaos
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *SWEEP, f"paths.output_dir={out}"],
        env=env,
        capture_output=True,
        text=True,
    )


def finals(out: Path) -> dict[str, dict]:
    result = {}
    for run in sorted((out / "runs").iterdir()):
        manifest = CheckpointDir(RunDir(run).store.link_dir("final")).load().manifest
        result[run.name] = {
            "lr": manifest["config"]["optimizer"]["lr"],
            "step": manifest["step"],
            "weights": manifest["files"]["weights.safetensors"]["sha256"],
            "optim": manifest["files"]["optim.safetensors"]["sha256"],
        }
    return result


@pytest.mark.slow
def test_interrupted_sweep_resumes_job_by_job(tmp_path):
    ref = sweep(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    # Kill the whole sweep inside its second job, after that job's epoch checkpoint (step 6 of 10):
    # each step passes 2 train kill points, so point 36 is job 2's step 8.
    killed = sweep(out, chaos="train:36")
    assert killed.returncode == -signal.SIGKILL
    runs = sorted((out / "runs").iterdir())
    status = {r.name: RunDir(r).read_status()["status"] for r in runs}
    assert sorted(status.values()) == ["complete", "running"]  # job 3 never started
    interrupted = next(r for r in runs if status[r.name] == "running")
    assert [s for s, _ in RunDir(interrupted).store.steps()] == [5, 6]
    done = sweep(out)
    assert done.returncode == 0, done.stderr
    log = done.stdout + done.stderr
    assert log.count("is complete at step 10") == 1  # the finished job was skipped, not retrained
    assert finals(out) == finals(tmp_path / "ref")
    assert len(finals(out)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_joblib_sweep_starts_its_workers_is_an_interruption_not_a_bad_config(
    tmp_path, sig
):
    """The workers exist but handle no signal yet (they import and compose first): the one passed on ends them,
    and the launcher's pool says a worker was terminated; the sweep still ends interrupted, exit 75, kept."""
    out = tmp_path / "out"
    args = [
        *SWEEP[:3],
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "optimizer.lr=0.01,0.02",
        f"paths.output_dir={out}",
    ]
    launcher = Proc(args, tmp_path / "cwd")
    wait_until(
        lambda: len(descendants(launcher.p.pid)) >= 3, "the pool's workers", launcher
    )  # 2 and the tracker
    launcher.send_signal(sig)
    assert launcher.wait() == 75, launcher.stderr[-3000:]
    assert "bad config" not in launcher.stderr
    # (a SIGINT passed on to a worker still importing Python's site module has that worker print its own traceback)
    assert "Traceback" not in launcher.stderr or sig == signal.SIGINT
    assert "the sweep was interrupted" in launcher.stderr
    (directory,) = (out / "sweeps").iterdir()
    assert json.loads((directory / "sweep.json").read_text())["status"] == "interrupted"
    done = run_pipeline(args, tmp_path / "cwd")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [RunDir(r).read_status()["status"] for r in (out / "runs").iterdir()] == [
        "complete",
        "complete",
    ]
