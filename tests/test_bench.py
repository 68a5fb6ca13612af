"""The benchmarks under bench/ still run against today's package (no test times them: each runs at a toy size)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

TINY = [
    "--vocab",
    "32",
    "--batch",
    "4",
    "--block",
    "8",
    "--n-embd",
    "16",
    "--n-head",
    "2",
    "--n-layer",
    "1",
]


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=cwd, capture_output=True, text=True
    )


def test_bench_checkpoint_saves_and_loads_through_the_package(tmp_path):
    # Its exit code is its targets' verdict (a 4 MiB state misses them on a busy machine): a crash is a traceback.
    done = run(
        "bench_checkpoint.py", "--mib", "4", "--repeats", "1", "--dir", str(tmp_path), cwd=tmp_path
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert "| CheckpointDir.load + verify (warm) |" in done.stdout


def test_bench_step_profiles_a_toy_model(tmp_path):
    done = run(
        "bench_step.py",
        "--profile",
        "--steps",
        "50",
        "--warmup",
        "1",
        *TINY,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mode"] == "profile" and result["ops"], result


def test_bench_step_races_torch_at_a_named_shape_overridden_to_a_toy(tmp_path):
    pytest.importorskip("torch")
    done = run(
        "bench_step.py",
        "--shape",
        "nanogpt-cpu",
        "--steps",
        "10",
        "--warmup",
        "1",
        *TINY,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shape"] == "nanogpt-cpu" and (result["V"], result["d"]) == (32, 16), result
    # Four torch contestants (sdpa and manual, OpenMP's default and PASSIVE), the ratio against the best of them
    assert {"torch_sdpa_passive_min_ms", "torch_manual_ms"} <= set(result) and result[
        "ratio_min"
    ] > 0
    assert result["torch_best_min"] in (
        "torch_sdpa",
        "torch_manual",
        "torch_sdpa_passive",
        "torch_manual_passive",
    )
    assert result["min_over_bound"] > 0
    # The same model, the same updates: every contestant's loss agrees with numpy's to float32 rounding
    losses = result["final_loss"]
    assert len(losses) == 5 and max(losses.values()) - min(losses.values()) < 1e-4, losses


@pytest.mark.slow  # a pipeline job (mlflow included) and two torch processes: minutes on a loaded machine
def test_bench_run_times_the_nanogpt_experiment_against_a_torch_loop(tmp_path):
    has_torch = importlib.util.find_spec("torch") is not None
    args = [
        "--max-steps",
        "3",
        "--eval-every",
        "2",
        "--bytes",
        "30000",
        "--keep",
        str(tmp_path / "work"),
    ]
    done = run("bench_run.py", *args, *([] if has_torch else ["--only", "pipeline"]), cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3 and not (tmp_path / "work" / "input.txt").is_symlink()
    sides = ["pipeline"] + (["torch", "torch_passive"] if has_torch else [])
    for side in sides:
        r = result[side]
        assert r["wall_s"] > 0 and r["peak_rss_mib"] > 0 and r["bytes_on_disk"] > 0, (side, r)
        assert math.isfinite(r["final_val_own"]) and r["split"]["forward/backward"] > 0, (side, r)
    assert {"data", "evaluation", "checkpoint", "tracking hand-over"} <= set(
        result["pipeline"]["split"]
    )
    if has_torch:
        # 3,000 validation characters: the pipeline's evaluation reads all of them, as the bench's scorer does
        # for both models: its scoring of the pipeline's checkpoint (loaded into the torch twin) is the same
        # loss (to float32 rounding; the windows' placement may differ by a few characters)
        p = result["pipeline"]
        assert abs(p["final_val_scored"] - p["final_val_own"]) < 2e-3, p
        assert result["wall_ratio"] > 0 and result["torch_best"] in ("torch", "torch_passive")
