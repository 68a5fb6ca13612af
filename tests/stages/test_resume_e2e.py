"""Interrupt and resume through the real command: SIGTERM chains, damaged checkpoints, a busy run directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.checkpoint import io
from pipeline.trainer.metrics_log import read_metrics

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LONG = ["experiment=kernodeck", "tracking=none", "trainer.max_steps=4000", "trainer.eval_every=500",
        "trainer.log_every=1", "checkpoint=every_n_steps", "checkpoint.every_steps=250"]


class Proc:
    """A running `python -m pipeline`, its output going to files (a full pipe would block it)."""

    def __init__(self, args: list[str], cwd: Path):
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
        env.pop("PIPELINE_CHAOS", None)
        cwd.mkdir(parents=True, exist_ok=True)
        self.err_path = cwd / f"stderr-{time.monotonic_ns()}.txt"
        with open(self.err_path, "w") as err:
            self.p = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env,
                                      stdout=subprocess.DEVNULL, stderr=err, text=True)

    def poll(self):
        return self.p.poll()

    def wait(self, timeout: float) -> int:
        return self.p.wait(timeout)

    def send_signal(self, sig) -> None:
        self.p.send_signal(sig)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()


def start(args: list[str], cwd: Path) -> Proc:
    return Proc(args, cwd)


def the_run(out: Path) -> Path:
    (d,) = [p for p in (out / "runs").iterdir() if p.is_dir()]
    return d


def wait_for_step(out: Path, step: int, proc: Proc, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        runs = list((out / "runs").glob("*/metrics.jsonl")) if (out / "runs").exists() else []
        if runs and (lines := read_metrics(runs[0])) and lines[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stderr[-2000:]}")
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def final_state(out: Path) -> dict:
    run = the_run(out)
    final = (run / "checkpoints" / "final").resolve()
    manifest = io.verify(final)
    return {"weights": manifest["files"]["weights.safetensors"]["sha256"],
            "optim": manifest["files"]["optim.safetensors"]["sha256"],
            "extra": json.loads((final / "extra.json").read_text()),
            "metrics": [{k: v for k, v in line.items() if k != "time"} for line in read_metrics(run / "metrics.jsonl")]}


MINIGPT = ["tracking=none", "trainer.max_steps=60", "trainer.eval_every=20", "trainer.log_every=1",
           "checkpoint=every_n_steps", "checkpoint.every_steps=20", "model.n_layer=1"]


@pytest.mark.parametrize("args,targets", [(LONG, (600, 1700, 2900)), (MINIGPT, (12, 31, 47))],
                         ids=["kernodeck", "minigpt"])
def test_sigterm_at_three_steps_then_resume_is_bit_identical(tmp_path, args, targets):
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    # Both runs share one generated corpus, as two runs under one output dir would.
    ref = start([*args, f"paths.output_dir={ref_out}"], tmp_path / "cwd")
    assert ref.wait(300) == 0, ref.stderr
    if (ref_out / "data").exists():
        out.mkdir()
        (out / "data").symlink_to(ref_out / "data")
    stopped_at = []
    for target in targets:
        proc = start([*args, f"paths.output_dir={out}"], tmp_path / "cwd")
        wait_for_step(out, target, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 75, proc.stderr
        status = json.loads((the_run(out) / "run.json").read_text())
        assert status["status"] == "preempted"
        stopped_at.append(status["step"])
    assert len(set(stopped_at)) == 3 and stopped_at == sorted(stopped_at), stopped_at
    proc = start([*args, f"paths.output_dir={out}"], tmp_path / "cwd")
    assert proc.wait(300) == 0, proc.stderr
    got, want = final_state(out), final_state(ref_out)
    assert got["metrics"] == want["metrics"]  # every loss, lr and grad norm, step by step
    assert got == want


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(cli, tmp_path):
    out = tmp_path / "out"
    args = ["experiment=kernodeck", "tracking=none", "trainer.max_steps=40", "checkpoint=every_n_steps",
            "checkpoint.every_steps=10", "~stages.best_val", f"paths.output_dir={out}"]
    ref = cli(*["experiment=kernodeck", "tracking=none", "trainer.max_steps=40", "checkpoint=every_n_steps",
                "checkpoint.every_steps=10", "~stages.best_val", f"paths.output_dir={tmp_path / 'ref'}"])
    assert ref.returncode == 0
    env_kill = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PIPELINE_CHAOS": "train:70"}  # 2 points per step
    killed = subprocess.run([sys.executable, "-m", "pipeline", *args], env=env_kill, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL
    run = the_run(out)
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert steps == [10, 20, 30]
    weights = run / "checkpoints" / "step-00000030" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # one flipped bit in tensor data: safetensors itself would load this silently
    weights.write_bytes(bytes(data))
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    log = r.stderr + r.stdout
    assert "step-00000030" in log and "sha256 differs" in log and "falling back" in log
    assert "resumed from" in log and "step-00000020" in log
    assert final_state(out) == final_state(tmp_path / "ref")


def test_second_process_on_a_busy_run_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    args = ["experiment=kernodeck", "tracking=none", "trainer.max_steps=200000", "trainer.log_every=100",
            "checkpoint=every_n_steps", "checkpoint.every_steps=100000", f"paths.output_dir={out}"]
    first = start(args, tmp_path / "cwd")
    try:
        wait_for_step(out, 200, first)
        second = start(args, tmp_path / "cwd2")
        assert second.wait(60) == 2
        err = second.stderr
        assert "is in use by another process" in err and str(the_run(out)) in err
        assert first.poll() is None  # the first run carries on undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 75
