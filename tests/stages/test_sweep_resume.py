"""Re-running an interrupted -m sweep: finished jobs are skipped, interrupted ones resume, missing ones start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.checkpoint import io

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SWEEP = ["-m", "experiment=kernodeck", "tracking=none", "optimizer.lr=0.01,0.02,0.03", "hydra/job_logging=disabled"]


def sweep(out: Path, chaos: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("PIPELINE_CHAOS", None)
    if chaos:
        env["PIPELINE_CHAOS"] = chaos
    return subprocess.run([sys.executable, "-m", "pipeline", *SWEEP, f"paths.output_dir={out}"], env=env,
                          capture_output=True, text=True, timeout=300)


def finals(out: Path) -> dict[str, dict]:
    result = {}
    for run in sorted((out / "runs").iterdir()):
        manifest = io.verify((run / "checkpoints" / "final").resolve())
        result[run.name] = {"lr": manifest["config"]["optimizer"]["lr"], "step": manifest["step"],
                            "weights": manifest["files"]["weights.safetensors"]["sha256"],
                            "optim": manifest["files"]["optim.safetensors"]["sha256"]}
    return result


def test_interrupted_sweep_resumes_job_by_job(tmp_path):
    ref = sweep(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    # Kill the whole sweep inside its second job, after that job's epoch checkpoint (step 6 of 10):
    # each step passes 2 train kill points, so point 36 is job 2's step 8.
    killed = sweep(out, chaos="train:36")
    assert killed.returncode == -signal.SIGKILL
    runs = sorted((out / "runs").iterdir())
    status = {r.name: json.loads((r / "run.json").read_text())["status"] for r in runs}
    assert sorted(status.values()) == ["complete", "running"]  # job 3 never started
    interrupted = next(r for r in runs if status[r.name] == "running")
    assert sorted(p.name for p in (interrupted / "checkpoints").glob("step-*")) == ["step-00000005", "step-00000006"]
    done = sweep(out)
    assert done.returncode == 0, done.stderr
    log = done.stdout + done.stderr
    assert log.count("is complete at step 10") == 1  # the finished job was skipped, not retrained
    assert finals(out) == finals(tmp_path / "ref")
    assert len(finals(out)) == 3
