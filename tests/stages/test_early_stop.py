"""Early stopping (pipeline/stages/early_stop.py): the rule on hand-made metric sequences, the step a real run
stops at against the patience computed from the uninterrupted run's own metrics, and resumes across it that
keep byte-identical checkpoints."""

from __future__ import annotations

import json
import math

import pytest
from conftest import KERNODECK, compose, kept, metrics, run_job, run_pipeline, the_run

from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.run.directory import RunDir
from pipeline.run.signals import SIGNALS_STATE
from pipeline.stages.base import StepEnd
from pipeline.stages.early_stop import EarlyStop


def early_stop(**kw) -> EarlyStop:
    return EarlyStop(
        **{"monitor": "m", "mode": "min", "patience": 3, "min_delta": 0.0, "order": 40, **kw}
    )


def feed(stage: EarlyStop, values: list) -> int | None:
    """Step (1-based) at which the stage ends the run, given one metric value per step (None: not measured)."""
    for step, v in enumerate(values, start=1):
        end = StepEnd(
            step=step,
            metrics={} if v is None else {stage.monitor: v},
            epoch_done=False,
            epochs_done=0,
            last=False,
        )
        if stage.stop_reason(end):
            return step
    return None


@pytest.mark.parametrize(
    "mode, min_delta, patience, values, stop",
    [
        # improvements reset the count; steps that measured nothing do not count
        ("min", 0.0, 2, [5.0, 4.0, None, 4.5, 3.0, 3.5, None, 3.2], 8),
        ("min", 0.0, 3, [5.0, 4.0, 4.5, 3.0, 3.5, 3.2], None),
        # min_delta: 3.95 is better than 4.0 but not by more than 0.1; 3.85 is
        ("min", 0.1, 2, [4.0, 3.95, 3.85, 3.8, 3.79], 5),
        # the best, not the last value, is the reference: a slow drift never beats it by min_delta
        ("min", 0.1, 3, [1.0, 0.95, 0.92, 0.91, 0.85], 4),
        ("max", 0.0, 2, [0.1, 0.2, 0.2, 0.3, 0.25, 0.3], 6),
        # NaN and infinities never improve (not even a first value, nor -inf in min mode)
        ("min", 0.0, 2, [math.nan, -math.inf], 2),
        ("min", 0.0, 3, [1.0, math.nan, -math.inf, 0.5, math.inf, math.nan, math.inf], 7),
        ("max", 0.0, 1, [1.0, math.inf], 2),
        # patience 1: the first evaluation without improvement ends it
        ("min", 0.0, 1, [3.0, 2.0, 2.0], 3),
    ],
)
def test_the_step_it_stops_at_is_the_hand_computed_patience(
    mode, min_delta, patience, values, stop
):
    assert feed(early_stop(mode=mode, patience=patience, min_delta=min_delta), values) == stop


def test_its_state_is_the_count_and_the_best_and_a_resumed_stage_decides_the_same():
    values = [5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 3.9, 3.8, 3.7, 3.6]
    whole = early_stop(patience=4)
    assert feed(whole, values) == 10
    for cut in range(1, 10):
        first = early_stop(patience=4)
        assert feed(first, values[:cut]) is None
        second = early_stop(patience=4)
        second.check_state_dict(first.state_dict())
        second.load_state_dict(first.state_dict())
        assert cut + feed(second, values[cut:]) == 10, cut
    assert whole.state_dict() == {
        "best": 3.0,
        "best_step": 6,
        "wait": 4,
        "monitor": "m",
        "mode": "min",
        "since": 0,
    }


@pytest.mark.parametrize(
    "state",
    [
        {"best": None, "best_step": 3, "wait": 0},
        {"best": 1.0, "best_step": None, "wait": 0},
        {"best": math.nan, "best_step": 3, "wait": 0},
        {"best": 1.0, "best_step": -1, "wait": 0},
        {"best": 1.0, "best_step": 3, "wait": -2},
        {"best": 1.0, "best_step": 3, "wait": 1.5},
    ],
)
def test_an_impossible_saved_state_is_refused(state):
    with pytest.raises(
        ValueError, match=r"is not a (best value and its step|finite number|count of evaluations)"
    ):
        early_stop().check_state_dict(state)


def test_the_config_option_is_typed_and_range_checked(tmp_path):
    from hydra.errors import HydraException

    from pipeline.config.compose import to_plain
    from pipeline.config.errors import ConfigError
    from pipeline.config.schemas import validate

    args = (*KERNODECK, "+stages/early_stop=default", f"paths.output_dir={tmp_path}")
    node = to_plain(compose(*args))["stages"]["early_stop"]
    assert node == {
        "_target_": "pipeline.stages.early_stop.EarlyStop",
        "monitor": "val/loss",
        "mode": "min",
        "patience": 3,
        "min_delta": 0.0,
        "order": 40,
    }
    assert (
        "early_stop" not in to_plain(compose(*KERNODECK, f"paths.output_dir={tmp_path}"))["stages"]
    )  # off by default
    with pytest.raises(HydraException):
        compose(*args, "stages.early_stop.mode=maximum")
    for bad, words in (
        ("stages.early_stop.patience=0", "stages.early_stop.patience=0: must be a number >= 1"),
        ("stages.early_stop.min_delta=-0.1", "stages.early_stop.min_delta=-0.1"),
    ):
        with pytest.raises(ConfigError, match=words):
            validate(to_plain(compose(*args, bad)))


# --- a real run: kernodeck for 60 updates; its uninterrupted metrics give the oracle
LONG = ("trainer.max_steps=60", "trainer.eval_every=2")
ARMED = {  # monitor val/loss every 2 updates with a min_delta; train/loss at every update, noisy (dropout)
    "val": ("+stages/early_stop=default", "stages.early_stop.min_delta=1e-4"),
    "train": (
        "+stages/early_stop=default",
        "stages.early_stop.monitor=train/loss",
        "stages.early_stop.patience=5",
    ),
}


def oracle_stop(lines: list[dict], monitor: str, patience: int, min_delta: float) -> int:
    """The step the patience rule stops at, computed from the logged metrics of the run that did not stop."""
    best, wait = math.inf, 0
    for line in lines:
        if monitor in line:
            if line[monitor] < best - min_delta:
                best, wait = line[monitor], 0
            else:
                wait += 1
                if wait == patience:
                    return line["step"]
    pytest.fail("the reference run never meets the stopping rule: choose another config")


@pytest.fixture(scope="module")
def reference(finished_job) -> list[dict]:
    return metrics(the_run(finished_job(*KERNODECK, *LONG)))


@pytest.mark.parametrize(
    "which, monitor, patience, min_delta",
    [("val", "val/loss", 3, 1e-4), ("train", "train/loss", 5, 0.0)],
)
def test_a_run_stops_at_the_step_its_own_metrics_give(
    tmp_path, reference, which, monitor, patience, min_delta
):
    stop = oracle_stop(reference, monitor, patience, min_delta)
    assert 10 < stop < 60  # it stops mid-run, after resets of its count (see the sequences)
    out = tmp_path / "out"
    assert run_job(*KERNODECK, *LONG, *ARMED[which], f"paths.output_dir={out}")[0] == 0
    run = RunDir(the_run(out))
    status = run.read_status()
    assert status["status"] == "complete" and status["step"] == stop
    assert status["ended"].startswith(
        f"early_stop: {monitor} did not improve in {patience} evaluations"
    )
    assert (
        metrics(run.path) == reference[:stop]
    )  # the same trajectory up to the stop, nothing after it
    assert run.store.link_step("final") == stop
    best = min(
        (ln for ln in reference[:stop] if "val/loss" in ln),
        key=lambda ln: (ln["val/loss"], ln["step"]),
    )
    assert run.store.link_step("best") == best["step"]
    assert (
        run_job(*KERNODECK, *LONG, *ARMED[which], f"paths.output_dir={out}")[0] == 0
    )  # complete: nothing to do
    assert RunDir(the_run(out)).read_status()["step"] == stop


@pytest.mark.parametrize(
    "which, k", [("val", 25), ("val", 37), ("val", 39), ("train", 12), ("train", 14)]
)
def test_a_resume_across_the_stop_point_keeps_identical_checkpoints(
    tmp_path, preempt_at, finished_job, which, k
):
    """Preempted inside the patience window (its count > 0), the resumed run stops where the uninterrupted one
    did, with byte-identical checkpoints, links and metrics."""
    args = (*KERNODECK, *LONG, *ARMED[which])
    ref, out = finished_job(*args), tmp_path / "out"
    preempt_at(k)
    assert run_job(*args, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    assert RunDir(the_run(out)).read_status()["step"] == k
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*args, f"paths.output_dir={out}")[0] == 0
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))
    assert (
        RunDir(the_run(out)).read_status()["ended"] == RunDir(the_run(ref)).read_status()["ended"]
    )


def test_the_verifier_passes_with_early_stopping_armed(tmp_path):
    """The protocol's workers step the state machines without the stages' decisions; the stage's state still
    rides through the interrupted checkpoint and its restore."""
    proc = run_pipeline(
        ["experiment=kernodeck", *ARMED["val"], f"paths.output_dir={tmp_path / 'out'}"],
        tmp_path / "cwd",
        module="pipeline.verify",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_chaos_kills_around_an_early_stop_still_end_bit_exact(tmp_path):
    """The real command, SIGKILLed inside steps and saves and re-run until it completes, stops where the
    uninterrupted run stops, with the same checkpoints' bytes, links and logged numbers."""
    proc = run_pipeline(
        [
            "experiment=kernodeck",
            *LONG,
            *ARMED["train"],
            "verify.kill=random",
            "verify.trials=4",
            f"paths.output_dir={tmp_path / 'out'}",
        ],
        tmp_path / "cwd",
        module="pipeline.verify",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = (tmp_path / "out" / "verify").glob("*/chaos/verification.json")
    report = json.loads(report.read_text())
    assert report["bit_exact"] == report["same_checkpoints_kept"] == report["trials"] == 4
