"""trainer.max_time (pipeline/run/budget.py): the format, the go-on rule on a fake clock, and a run whose budget
expires mid-run exiting 75 at the hand-computed steps and finishing, requeue after requeue, byte-identical to
the run that never stopped. No wall-clock assertions: the clock is the test's, or anything the machine gives."""

from __future__ import annotations

import pytest
from conftest import KERNODECK, config_of, kept, metrics, run_job, run_pipeline, the_run

import pipeline.run.budget as budget
from pipeline.config.checks import parse_duration
from pipeline.config.errors import EXIT_PREEMPTED, ConfigError
from pipeline.config.schemas import validate
from pipeline.run.budget import Budget
from pipeline.run.directory import RunDir


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("00:03:50:00", 13800.0),
        ("01:00:00:00", 86400.0),
        ("00:00:00:01", 1.0),
        ("2:23:59:59", 2 * 86400 + 86399.0),
    ],
)
def test_dd_hh_mm_ss(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["3:50:00", "00:24:00:00", "00:00:60:00", "00:00:00:00", "1h", "", "-1:00:00:00"]
)
def test_other_formats_are_refused_naming_the_one_expected(text, tmp_path):
    with pytest.raises(ValueError, match=r"must be (DD:HH:MM:SS|a positive duration)"):
        parse_duration(text)
    with pytest.raises(ConfigError, match=r"trainer.max_time=.*: must be"):
        validate(
            config_of(*KERNODECK, f"trainer.max_time='{text}'", f"paths.output_dir={tmp_path}")
        )


def test_max_time_is_not_part_of_the_run_identity(tmp_path):
    from pipeline.config.identity import run_name

    a = config_of(*KERNODECK, f"paths.output_dir={tmp_path}")
    b = config_of(*KERNODECK, "trainer.max_time=00:03:50:00", f"paths.output_dir={tmp_path}")
    validate(b)
    assert a["trainer"]["max_time"] is None and b["trainer"]["max_time"] == "00:03:50:00"
    assert run_name(a) == run_name(b)


@pytest.fixture
def clock(monkeypatch):
    """A fake clock read by pipeline.run.budget: the process is 0 s old when its Run is built, and it stands still
    except where the test moves it."""
    now = {"t": 0.0}
    monkeypatch.setattr(budget, "monotonic", lambda: now["t"])
    monkeypatch.setattr(budget, "process_age", lambda: 0.0)
    return now


def test_it_goes_on_while_one_more_step_and_save_fit(clock):
    b = Budget(60.0)
    b.start()
    clock["t"] = 10.0
    assert not b.step_ended()  # 10 + slowest step 10 < 60
    b.saved(25.0)
    clock["t"] = 20.0
    assert not b.step_ended()  # 20 + 10 + 25 = 55 < 60
    clock["t"] = 30.0
    assert b.step_ended()  # 30 + 10 + 25 = 65: checkpoint now
    clock["t"] = 0.0
    late = Budget(60.0, age=55.0)  # a process that started 55 s ago: 5 s left
    late.start()
    clock["t"] = 4.0
    assert late.step_ended()  # 4 + 4 >= 5
    assert not Budget(None).step_ended()


def test_the_age_counts_from_the_process_start():
    # The process started before this module was imported (with /proc's clock-tick resolution to spare).
    assert budget.process_age() >= budget.monotonic() - budget._IMPORTED - 0.02


LONG = ("trainer.max_steps=30",)


def test_a_budget_that_expires_mid_run_exits_75_and_requeues_finish_bit_exactly(
    tmp_path, monkeypatch, clock, finished_job
):
    """Every update takes 10 s of the fake clock, saves none, and each process has 60 s: it goes on after step k
    only if 10 k + 10 < 60, so every process stops after 5 updates (steps 5, 10, ... 25), and the sixth ends at
    step 30, the last. Checkpoints, links and metrics equal the uninterrupted run's."""
    import pipeline.trainer.loop as loop

    ref, out = finished_job(*KERNODECK, *LONG), tmp_path / "out"
    real = loop.train_step

    def step(state):
        record = real(state)
        clock["t"] += 10.0
        return record

    monkeypatch.setattr(loop, "train_step", step)
    exits, stopped_at = [], []
    for _ in range(10):
        clock["t"] = 0.0  # a fresh process
        code, _ = run_job(
            *KERNODECK, *LONG, "trainer.max_time=00:00:01:00", f"paths.output_dir={out}"
        )
        exits.append(code)
        status = RunDir(the_run(out)).read_status()
        stopped_at.append(status["step"])
        if code != EXIT_PREEMPTED:
            break
        assert (
            status["status"] == "preempted"
            and status["preempted_by"] == "trainer.max_time=00:00:01:00"
        )
    assert exits == [EXIT_PREEMPTED] * 5 + [0]
    assert stopped_at == [5, 10, 15, 20, 25, 30]
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))


@pytest.mark.slow
def test_real_processes_with_a_one_second_budget_finish_bit_exactly(tmp_path):
    """The real clock, real processes: whatever this machine's speed makes of a 1 s budget (every process makes
    at least one update), re-running the identical command until it exits 0 gives the uninterrupted bytes."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_job(*KERNODECK, f"paths.output_dir={ref}")[0] == 0
    exits = []
    while not exits or exits[-1] != 0:
        assert len(exits) <= 10, exits  # 10 updates: at most 10 processes
        proc = run_pipeline(
            [*KERNODECK, "trainer.max_time=00:00:00:01", f"paths.output_dir={out}"],
            tmp_path / "cwd",
        )
        assert proc.returncode in (0, EXIT_PREEMPTED), proc.stderr
        exits.append(proc.returncode)
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))
