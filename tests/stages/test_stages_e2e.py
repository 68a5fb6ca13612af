"""Stages from config, end to end through `python -m pipeline` (kernodeck: 24 rows, 6 updates per epoch)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.checkpoint import io

BASE = ["experiment=kernodeck", "tracking=none", "trainer.eval_every=0"]


def run_dir(out: Path) -> Path:
    (d,) = [p for p in (out / "runs").iterdir() if p.is_dir()]
    return d


def ckpt_steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


def link(run: Path, name: str) -> int:
    return int(os.readlink(run / "checkpoints" / name).split("-")[1])


def test_default_cadence_over_7_epochs_keeps_3_newest_plus_best_plus_final(cli, tmp_path):
    # mode=max makes epoch 1 (the highest val loss) the best, so best is not among the newest three.
    out = tmp_path / "out"
    r = cli(*BASE, "trainer.max_steps=0", "trainer.epochs=7", "stages.best_val.mode=max", f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    run = run_dir(out)
    assert ckpt_steps(run) == [6, 30, 36, 42]  # best (epoch 1) + the 3 newest epochs; final is epoch 7
    assert link(run, "best") == 6 and link(run, "final") == 42
    for step in ckpt_steps(run):
        io.verify(run / "checkpoints" / f"step-{step:08d}")
    assert json.loads((run / "run.json").read_text())["status"] == "complete"


def test_removing_and_retuning_and_adding_stages_by_override(cli, tmp_path):
    out = tmp_path / "a"
    r = cli(*BASE, "trainer.max_steps=0", "trainer.epochs=7", "~stages.best_val", "stages.rotate_last_3.keep=5",
            f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    run = run_dir(out)
    assert not (run / "checkpoints" / "best").exists()
    assert ckpt_steps(run) == [18, 24, 30, 36, 42]
    out = tmp_path / "b"
    extra = ("+stages.every_4={_target_:pipeline.stages.rotate.RotateLastN,keep:1,order:25,"
             "cadence:{_target_:pipeline.stages.cadence.Cadence,every_epochs:0,every_steps:4}}")
    r = cli(*BASE, "trainer.max_steps=0", "trainer.epochs=3", "~stages.best_val", extra, f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    # epochs end at 6, 12, 18 (all kept: 3 newest); the extra stage keeps only its newest, step 16.
    assert ckpt_steps(run_dir(out)) == [6, 12, 16, 18]
    out = tmp_path / "c"
    r = cli(*BASE, "~stages.final", "~stages.rotate_last_3", "~stages.best_val", f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    assert ckpt_steps(run_dir(out)) == []


def test_rerunning_a_complete_run_exits_0_without_training(cli, tmp_path):
    out = tmp_path / "out"
    args = [*BASE, f"paths.output_dir={out}"]
    assert cli(*args).returncode == 0
    run = run_dir(out)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts
              and p.name not in ("pipeline.log", ".lock")}
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "is complete at step 10" in r.stdout and "val/loss=" in r.stdout
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in before}
    assert after == before


def test_drift_is_refused_naming_keys_and_allow_changes_lets_them_through(cli, tmp_path):
    out = tmp_path / "out"
    assert cli(*BASE, f"paths.output_dir={out}").returncode == 0
    final = (run_dir(out) / "checkpoints" / "final").resolve()
    r = cli(*BASE, "optimizer.lr=0.05", "trainer.max_steps=12", f"resume.source={final}", f"paths.output_dir={out}")
    assert r.returncode == 2
    msg = r.stderr + r.stdout
    assert "optimizer.lr: 0.03 -> 0.05" in msg and "trainer.max_steps: 10 -> 12" in msg
    r = cli(*BASE, "optimizer.lr=0.05", "trainer.max_steps=12", f"resume.source={final}",
            "resume.allow_changes=[optimizer.lr,trainer.max_steps]", f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    runs = sorted(p for p in (out / "runs").iterdir() if p.is_dir())
    new = [p for p in runs if p != final.parent.parent][0]
    manifest = json.loads((new / "checkpoints" / "final" / "manifest.json").read_text())
    assert manifest["step"] == 12
    assert manifest["allowed_changes"] == {"optimizer.lr": [0.03, 0.05], "trainer.max_steps": [10, 12]}
