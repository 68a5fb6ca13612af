"""The benchmarks under bench/ still run against today's package (no test times them: each runs at a toy size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


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
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mode"] == "profile" and result["ops"], result
