"""Re-running an interrupted -m sweep: finished jobs are skipped, interrupted ones resume, missing ones start."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_for_subprocess

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.run.directory import RunDir

SWEEP = ["-m", "experiment=kernodeck", "tracking=none", "optimizer.lr=0.01,0.02,0.03", "hydra/job_logging=disabled"]


def sweep(out: Path, chaos: str | None = None) -> subprocess.CompletedProcess:
    env = env_for_subprocess()
    if chaos:
        env["PIPELINE_CHAOS"] = chaos
    return subprocess.run([sys.executable, "-m", "pipeline", *SWEEP, f"paths.output_dir={out}"], env=env,
                          capture_output=True, text=True)


def finals(out: Path) -> dict[str, dict]:
    result = {}
    for run in sorted((out / "runs").iterdir()):
        manifest = CheckpointDir(RunDir(run).store.link_dir("final")).verify()
        result[run.name] = {"lr": manifest["config"]["optimizer"]["lr"], "step": manifest["step"],
                            "weights": manifest["files"]["weights.safetensors"]["sha256"],
                            "optim": manifest["files"]["optim.safetensors"]["sha256"]}
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
