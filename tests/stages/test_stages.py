"""Stages from config, end to end (kernodeck: 24 rows, 6 updates per epoch): cadence, retention, links,
removing, re-tuning and adding stages by override, typed stage options."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import KERNODECK, compose, env_for_subprocess, run_job, the_run

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.run.directory import RunDir

BASE = (*KERNODECK, "trainer.eval_every=0")


def steps(run) -> list[int]:
    return [s for s, _ in RunDir(run).store.steps()]


def test_default_cadence_over_7_epochs_keeps_3_newest_plus_best_plus_final(tmp_path):
    # mode=max makes epoch 1 (the highest val loss) the best, so best is not among the newest three.
    out = tmp_path / "out"
    assert (
        run_job(
            *BASE,
            "trainer.max_steps=0",
            "trainer.epochs=7",
            "stages.best_val.mode=max",
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    run = the_run(out)
    store = RunDir(run).store
    assert steps(run) == [6, 30, 36, 42]  # best (epoch 1) + the 3 newest epochs; final is epoch 7
    assert store.link_step("best") == 6 and store.link_step("final") == 42
    for _, d in store.steps():
        CheckpointDir(d).load()
    assert RunDir(run).read_status()["status"] == "complete"


def test_removing_and_retuning_and_adding_stages_by_override(tmp_path):
    out = tmp_path / "a"
    assert (
        run_job(
            *BASE,
            "trainer.max_steps=0",
            "trainer.epochs=7",
            "~stages.best_val",
            "stages.rotate_last_3.keep=5",
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    run = the_run(out)
    assert "best" not in RunDir(run).store.links()
    assert steps(run) == [18, 24, 30, 36, 42]
    out = tmp_path / "b"
    extra = (
        "+stages.every_4={_target_:pipeline.stages.rotate.RotateLastN,keep:1,order:25,"
        "cadence:{_target_:pipeline.stages.cadence.Cadence,every_epochs:0,every_steps:4}}"
    )
    assert (
        run_job(
            *BASE,
            "trainer.max_steps=0",
            "trainer.epochs=3",
            "~stages.best_val",
            extra,
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    # epochs end at 6, 12, 18 (all kept: 3 newest); the extra stage keeps only its newest, step 16.
    assert steps(the_run(out)) == [6, 12, 16, 18]
    out = tmp_path / "c"
    assert (
        run_job(
            *BASE,
            "~stages.final",
            "~stages.rotate_last_3",
            "~stages.best_val",
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    assert steps(the_run(out)) == [
        10
    ]  # the end is always saved (and the newest pinned): a rerun knows it is done


def test_rerunning_a_complete_run_exits_0_without_training(tmp_path, capsys):
    out = tmp_path / "out"
    args = (*BASE, f"paths.output_dir={out}")
    assert run_job(*args)[0] == 0
    run = the_run(out)
    before = {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in run.rglob("*")
        if p.is_file() and ".hydra" not in p.parts and p.name not in ("pipeline.log", ".lock")
    }
    code, objective = run_job(*args)
    assert code == 0 and objective == pytest.approx(
        RunDir(run).read_status()["metrics"]["val/loss"]
    )
    assert "is complete at step 10" in capsys.readouterr().out
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in before} == before


def test_a_stage_removed_on_resume_keeps_its_link_and_checkpoint(tmp_path, preempt_at):
    """stages are not part of the run's identity: dropping best_val mid-run must not delete the best."""
    from pipeline.run.signals import SIGNALS_STATE

    out = tmp_path / "out"
    args = (
        *KERNODECK,
        "trainer.max_steps=30",
        "stages.best_val.mode=max",
        f"paths.output_dir={out}",
    )
    preempt_at(20)
    assert run_job(*args)[0] == 75
    SIGNALS_STATE.received = None
    preempt_at(None)
    best = RunDir(the_run(out)).store.link_step("best")
    assert run_job(*args, "~stages.best_val")[0] == 0
    store = RunDir(the_run(out)).store
    assert store.link_step("best") == best and best in steps(the_run(out))


@pytest.mark.parametrize(
    "override, key",
    [
        ("stages.best_val.mode=maximum", "stages.best_val.mode"),
        ("stages.rotate_last_3.keep=zero", "stages.rotate_last_3.keep"),
        ("stages.train.eval_every=-1", "stages.train.eval_every"),
    ],
)
def test_stage_options_are_typed(override, key, tmp_path):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config.compose import to_plain
    from pipeline.config.errors import ConfigError
    from pipeline.config.schemas import validate

    with pytest.raises((HydraException, OmegaConfBaseException, ConfigError)) as info:
        validate(to_plain(compose(*KERNODECK, override, f"paths.output_dir={tmp_path}")))
    assert key.split(".")[-1] in str(info.value)


def test_a_stage_is_a_policy_fed_plain_values_that_never_sees_the_run():
    """Importing every stage module imports nothing of pipeline/run/ (a second process: this one has), and no
    method of a stage takes the run or a run directory: it is handed a StepEnd and its own saved state."""
    import importlib
    import inspect
    import pkgutil

    import pipeline.stages as package
    from pipeline.stages.base import Stage

    code = (
        "import importlib, pkgutil, sys, pipeline.stages as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('pipeline.stages.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k.startswith('pipeline.run')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env_for_subprocess(), capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr + proc.stdout
    stages = {
        c
        for m in pkgutil.iter_modules(package.__path__)
        for _, c in inspect.getmembers(importlib.import_module(f"pipeline.stages.{m.name}"))
        if inspect.isclass(c) and issubclass(c, Stage)
    }
    assert len(stages) >= 5 and not hasattr(Stage, "setup") and not hasattr(Stage, "run")
    for cls in stages:
        for name, method in inspect.getmembers(cls, inspect.isfunction):
            taken = set(inspect.signature(method).parameters)
            assert not taken & {"run", "rundir", "job"}, f"{cls.__name__}.{name} takes {taken}"


def test_a_checkpoint_of_when_resume_and_train_were_stages_loads_without_a_word():
    """Checkpoints written while resume and train were stages hold an empty state for each: accepted and
    dropped unsaid; a saved state of a stage this config lacks is still dropped with a note."""
    from pipeline.stages.base import StageStates
    from pipeline.stages.final import Final

    states = StageStates([Final(order=90)])
    saved = {"resume": {}, "train": {}, "final": {}}
    states.check_state_dict(saved)
    states.load_state_dict(saved)
    assert (states.notes, states.fresh) == ([], set())
    states.load_state_dict({**saved, "best_val": {}})
    assert states.notes == ["best_val: no such stage in this config, its saved state is dropped"]
