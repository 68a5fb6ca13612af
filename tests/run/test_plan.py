"""The plan of a run's set-up as a value (run/plan.py): one test per kind of history it continues, each
planned over a real run directory that planning leaves exactly as it was."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import KERNODECK, config_of, run_job, the_run, tree

from pipeline.config.identity import lineage_of
from pipeline.files import jsonio
from pipeline.run.directory import RunDir
from pipeline.run.job import build
from pipeline.run.plan import DriftError, Plan, plan, settings


def planned(out: Path, *overrides: str) -> Plan:
    """The plan of the kernodeck job with `overrides` in `out`; asserts that planning wrote nothing."""
    config = config_of(*KERNODECK, f"paths.output_dir={out}", *overrides)
    job = build(config)
    try:
        before = tree(out, mtimes="all")
        assert job.run_dir is not None
        value = plan(RunDir(job.run_dir), job, settings(config)[0], started=1.0, in_sweep=False)
        assert tree(out, mtimes="all") == before, "planning wrote"
        return value
    finally:
        job.state.runner.close()


@pytest.fixture
def preempted(tmp_path, preempt_at) -> Path:
    """A kernodeck run preempted at step 8: checkpoints of steps 6 (its first epoch's end) and 8."""
    preempt_at(8)
    out = tmp_path / "out"
    assert run_job(*KERNODECK, f"paths.output_dir={out}")[0] == 75
    return out


def test_a_fresh_start_continues_nothing_and_moves_nothing(tmp_path):
    p = planned(tmp_path / "out")
    assert (p.resumed, p.complete, p.supersede, p.fallback, p.metrics) == (
        None,
        False,
        None,
        (),
        None,
    )
    assert p.lineage["origin"] is None and p.history == {"started": 1.0, "resumes": []}


def test_continuing_its_own_history_from_its_newest_checkpoint(preempted):
    p = planned(preempted)
    assert p.resumed is not None and p.resumed.step == 8 and not p.complete
    assert p.lineage == p.resumed.manifest["lineage"] and p.supersede is None
    assert [ln["step"] for ln in p.metrics or ()] == list(range(1, 9)) and not p.cut
    assert [r["step"] for r in p.history["resumes"]] == [8] and (p.fallback, p.retuned) == ((), ())


def test_a_complete_run_is_confirmed_as_it_is(finished_job):
    p = planned(finished_job(*KERNODECK))
    assert p.complete and p.settled and p.metrics is None and not p.cut
    assert p.resumed is not None and p.history["resumes"] == []


def test_a_damaged_newest_checkpoint_is_fallen_back_past_and_set_aside(preempted):
    newest = RunDir(the_run(preempted)).store.root / "step-00000008" / "weights.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 1
    newest.write_bytes(bytes(data))
    p = planned(preempted)
    assert p.resumed is not None and p.resumed.step == 6
    ((directory, what, why),) = p.fallback
    assert directory.name == "step-00000008" and what == "a damaged checkpoint"
    assert "sha256 differs" in why
    # metrics.jsonl holds steps 7 and 8, past the checkpoint it continues: cut, kept whole aside
    assert p.cut and [ln["step"] for ln in p.metrics or ()] == list(range(1, 7))


def test_metrics_past_the_checkpoint_are_cut(preempted):
    path = RunDir(the_run(preempted)).metrics_path
    with path.open(
        "ab"
    ) as f:  # what a process killed between its log line and its checkpoint leaves
        f.write(jsonio.dumps_line({"step": 9, "train/loss": 1.0}).encode() + b"\n")
    p = planned(preempted)
    assert p.resumed is not None and p.resumed.step == 8 and p.cut
    assert [ln["step"] for ln in p.metrics or ()] == list(range(1, 9))


def test_a_retuned_policy_keeps_the_checkpoints_as_they_stood(preempted):
    p = planned(preempted, "stages.rotate_last_3.keep=5")
    assert p.resumed is not None and p.resumed.step == 8
    assert p.retuned == ("stages.rotate_last_3.keep 3 -> 5",) and p.supersede is None


def test_a_fork_continues_another_runs_checkpoint_as_another_lineage(preempted, tmp_path):
    source = RunDir(the_run(preempted)).store.root / "step-00000006"
    p = planned(tmp_path / "fork", f"resume.source={source}")
    assert p.resumed is not None and p.resumed.directory == source.resolve()
    assert p.lineage["origin"]["checkpoint"] == str(source.resolve())
    assert p.lineage != p.resumed.manifest["lineage"] and p.supersede is None
    assert [ln["step"] for ln in p.metrics or ()] == list(
        range(1, 7)
    )  # the source run's, to its step


def test_a_fork_into_a_directory_holding_another_history_moves_it_whole(preempted, tmp_path):
    source = RunDir(the_run(preempted)).store.root / "step-00000006"
    fork = tmp_path / "fork"
    shutil.copytree(preempted, fork, symlinks=True)
    own = the_run(fork)
    config = config_of(*KERNODECK, f"paths.output_dir={fork}", f"resume.source={source}")
    job = build(config)
    job.state.runner.close()
    assert job.run_dir is not None
    shutil.move(own, job.run_dir)  # another history where the fork runs
    p = planned(fork, f"resume.source={source}")
    assert p.supersede == str(source.resolve())
    assert p.lineage == job.lineage != lineage_of(job.facts["semantic_config_hash"], None)


def test_a_checkpoint_of_other_code_is_continued_and_said(preempted, monkeypatch):
    import pipeline.checkpoint.manifest as mf

    monkeypatch.setattr(mf, "code_change", lambda manifest, facts=None: "commit 0123 -> 4567")
    p = planned(preempted)
    assert p.resumed is not None and p.other_code == "commit 0123 -> 4567" and not p.complete


def test_a_run_holds_its_plan_and_at_most_8_attributes(finished_job):
    from pipeline.run.loop import Run

    out = finished_job(*KERNODECK)
    config = config_of(*KERNODECK, f"paths.output_dir={out}")
    job = build(config)
    try:
        assert job.run_dir is not None
        rundir = RunDir(job.run_dir)
        p = plan(rundir, job, settings(config)[0], started=1.0, in_sweep=False)
        run = Run(job, rundir, p, [], None)
        assert run.plan is p and len(vars(run)) <= 8, sorted(vars(run))
    finally:
        job.state.runner.close()


def test_resume_settings_written_under_stages_resume_still_apply(preempted, tmp_path):
    """stages.resume is a node of settings, no stage: an allow_changes written there lets the change through."""
    source = RunDir(the_run(preempted)).store.root / "step-00000008"
    more = (f"resume.source={source}", "trainer.max_steps=12")
    p = planned(tmp_path / "more", *more, "stages.resume.allow_changes=[trainer.max_steps]")
    assert p.resumed is not None and p.resumed.step == 8
    assert p.allowed == {"trainer.max_steps": [10, 12]}
    with pytest.raises(DriftError, match=re.escape("resume.allow_changes=[trainer.max_steps]")):
        planned(tmp_path / "more", *more)
