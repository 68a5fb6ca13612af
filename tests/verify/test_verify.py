"""The resume verifier: seed 003's facts, each state machine's broken restore named, the negative control."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import KERNODECK, PROJECT_ROOT, env_for_subprocess

# Each patch makes one state machine's restore do nothing, in every worker process (via sitecustomize).
BREAK = {
    "model": "import pipeline.model.base as m; m.NamedParams.load_state_dict = lambda self, s: None",
    "optimizer": "import pipeline.optimizer.base as m; m.Optimizer.load_state_dict = lambda self, s: None",
    "scheduler": "import pipeline.scheduler.base as m; m.Scheduler.load_state_dict = lambda self, s: None",
    "data_iter": "import pipeline.data.iterator as m; m.DataIterator.load_state_dict = lambda self, s: None",
    "rng": "import pipeline.trainer.rng as m; m.Streams.load_state_dict = lambda self, s: None",
}


def verify(args: list[str], out: Path, patch: str | None = None, tmp: Path | None = None):
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    if patch is not None:
        site = tmp / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(patch) + "\n")
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(PROJECT_ROOT)])
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.verify", *args, f"paths.output_dir={out}"],
        env=env,
        capture_output=True,
        text=True,
    )
    reports = list((out / "verify").glob("*/verification.json"))
    return r, (json.loads(reports[0].read_text()) if reports else None)


def test_kernodeck_reproduces_seed_003(tmp_path):
    r, report = verify(["experiment=kernodeck"], tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        report["positive"]
        and report["negative_divergence_detected"]
        and report["all_checks_passed"]
    )
    assert (
        report["max_weight_diff"]["positive"] == 0.0 and report["eval_loss_diff"]["positive"] == 0.0
    )
    assert report["max_weight_diff"]["negative"] > 1e-3  # the seed saw 0.0117
    assert report["cursor_at_cut"] == "20/24"
    assert report["next_lr"]["continuous"] == report["next_lr"]["resume"] == 0.00375
    assert report["tolerance"] == {"atol": 0.0, "rtol": 0.0, "mode": "exact (the same bytes)"}
    names = {c["name"] for c in report["comparisons"]}
    assert {
        "records/ids",
        "records/lr",
        "records/loss",
        "eval/losses",
        "optimizer/t",
        "data_iter/position",
        "scheduler/last_epoch",
        "rng/next.dropout",
        "rng/next.python",
        "progress/step",
        "progress/clipped",
    } <= names
    assert all(c["positive_max_abs_diff"] == 0.0 for c in report["comparisons"])
    assert len(report["commands"]) == 5


@pytest.mark.parametrize("machine", sorted(BREAK))
def test_a_broken_restore_fails_naming_its_state_machine(tmp_path, machine):
    r, report = verify(["experiment=kernodeck"], tmp_path / "out", BREAK[machine], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert report["positive"] is False
    assert machine in report["restore_failures"], report["restore_failures"]
    assert machine in report["reason"] and machine in r.stdout


def test_no_randomness_after_the_cut_means_the_negative_control_cannot_diverge(tmp_path):
    # No dropout, no input gain or noise, and the new epoch's permutation drawn before the cut (step 7).
    args = [
        "experiment=kernodeck",
        "model.dropout=0",
        "data.input_gain=0",
        "data.input_noise=0",
        "verify.cut=7",
    ]
    r, report = verify(args, tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert report["positive"] is True and report["negative_divergence_detected"] is False
    assert "cannot diverge" in report["reason"]
    # the failure line says why and what would give the control something to differ by
    assert (
        f"FAILED: {report['reason']}\n" in r.stdout
        and "add dropout or data augmentation" in report["reason"]
    )


def test_incomplete_verification_exits_2(tmp_path):
    r, report = verify(["experiment=kernodeck", "trainer.batch_size=100"], tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert report["positive"] is None and "process exited" in report["reason"]
    r, _ = verify(["experiment=kernodeck", "verify.cut=12"], tmp_path / "out2")
    assert r.returncode == 2 and "verify.cut" in r.stderr


def test_a_worker_refuses_a_class_its_command_line_does_not_allow_in_one_line(tmp_path):
    """The worker ends through the one entry wrapper: one line naming its config file, exit 2, nothing run."""
    from pipeline.config.compose import compose, to_plain

    config = to_plain(compose([*KERNODECK, f"paths.output_dir={tmp_path / 'out'}"]))
    config["model"] = {"_target_": "io.FileIO", "file": str(tmp_path / "sentinel"), "mode": "w"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = [
        "--config",
        tmp_path / "config.json",
        "--mode",
        "continuous",
        "--cut",
        "1",
        "--steps",
        "2",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.verify.worker", *args, "--out", tmp_path / "worker"],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.splitlines()
    assert (
        line.startswith(f"pipeline.verify.worker: {tmp_path / 'config.json'}: ") and "model" in line
    )
    assert not (tmp_path / "worker").exists() and not (tmp_path / "sentinel").exists()


def test_a_link_planted_where_a_verification_writes_is_removed_never_followed(tmp_path):
    from pipeline.config.compose import compose, to_plain
    from pipeline.verify.protocol import verify_dir

    config = to_plain(compose([*KERNODECK, f"paths.output_dir={tmp_path / 'out'}"]))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "v.txt").write_text("precious\n")
    first = verify_dir(config)
    (first / "old.json").write_text("{}")
    assert list(verify_dir(config).iterdir()) == []  # an earlier verification's files removed
    first.rmdir()
    first.symlink_to(victim)
    assert verify_dir(config) == first and first.is_dir() and not first.is_symlink()
    assert [p.name for p in victim.iterdir()] == ["v.txt"]


@pytest.mark.slow  # chaos: 41 real processes, 20 of them SIGKILLed
def test_chaos_mode_20_trials_bit_exact_with_kills_inside_saves(tmp_path):
    """With accumulation (2 micro-batches an update) and clipping on every update (grad norms 0.6-1.6)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.verify",
            "experiment=kernodeck",
            "tracking=none",
            "trainer.accumulate=2",
            "trainer.grad_clip=0.3",
            "verify.kill=random",
            "verify.trials=20",
            f"paths.output_dir={tmp_path}",
        ],
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp_path / "verify").glob("*/chaos/verification.json")
    report = json.loads(path.read_text())
    assert (
        report["trials"] == 20
        and report["bit_exact"] == 20
        and report["same_checkpoints_kept"] == 20
    )
    assert report["kills_by_phase"]["save"] >= 1 and report["kills_by_phase"]["train"] >= 1
    assert report["invalid_visible_checkpoints"] == []
    assert all(t["killed"] for t in report["trial_records"])


@pytest.mark.slow  # longer training: the default MiniGPT, in 5 processes
def test_default_minigpt_config_verifies_with_accumulation_clipping_and_early_stopping(tmp_path):
    """The default job with 4 micro-batches an update, every update clipped (its norms are ~1.5) and early
    stopping armed."""
    r, report = verify(
        ["trainer.accumulate=4", "trainer.grad_clip=0.5", "+stages/early_stop=default"],
        tmp_path / "out",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert report["all_checks_passed"] and report["max_weight_diff"]["positive"] == 0.0
    names = {c["name"] for c in report["comparisons"]}
    assert "model/lm_head.weight" in names and "model/transformer.wte.weight" in names
