"""A multirun's job is an object passed in, never a process global: what it records at its end, and how."""

from __future__ import annotations

import json
import math
import os
import pickle
import types

import pytest
from omegaconf import OmegaConf

from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED
from pipeline.run import job as runner
from pipeline.run.sweep import SweepInterrupted, SweepJob
from pipeline.sweep import callback as sweep_callback


def sweep_job(tmp_path, **kw) -> SweepJob:
    return SweepJob(
        dir=tmp_path,
        sweep_id="abc",
        num=3,
        overrides=["optimizer.lr=0.1"],
        name="optimizer.lr=0.1",
        started=100.0,
        **kw,
    )


def record_of(tmp_path, num: int = 3) -> dict:
    return json.loads((tmp_path / "jobs" / f"{num}.json").read_text())


def test_a_complete_job_records_its_run_and_objective(tmp_path):
    job = sweep_job(
        tmp_path, run_dir="/runs/a", run_uri="sqlite:///x#/experiments/1/runs/" + "0" * 32
    )
    job.record(0.25)
    r = record_of(tmp_path)
    assert {
        k: r[k]
        for k in (
            "sweep_id",
            "num",
            "overrides",
            "name",
            "run_dir",
            "run_uri",
            "started",
            "objective",
            "status",
        )
    } == {
        "sweep_id": "abc",
        "num": 3,
        "overrides": ["optimizer.lr=0.1"],
        "name": "optimizer.lr=0.1",
        "run_dir": "/runs/a",
        "run_uri": job.run_uri,
        "started": 100.0,
        "objective": 0.25,
        "status": "complete",
    }
    assert r["ended_at"] >= 100.0 and "code" not in r


@pytest.mark.parametrize(
    "code, status", [(EXIT_BAD_INPUT, "failed"), (EXIT_PREEMPTED, "preempted")]
)
def test_a_job_that_failed_records_its_code_and_error(tmp_path, code, status):
    job = sweep_job(tmp_path, failure={"code": code, "error": "why"})
    job.record(math.nan)
    r = record_of(tmp_path)
    assert (r["status"], r["code"], r["error"]) == (status, code, "why")


def test_an_exception_out_of_a_job_is_recorded_with_code_1_and_raised_on(tmp_path, monkeypatch):
    """What Hydra's on_job_end saw as a FAILED job return: the job runner records it, then Hydra gets it."""

    def broken(*a):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(runner, "_job", broken)
    job = sweep_job(tmp_path)
    with pytest.raises(ZeroDivisionError):
        runner.main({}, [], "", job)
    r = record_of(tmp_path)
    assert (r["status"], r["code"], r["error"], r["objective"]) == (
        "failed",
        1,
        "ZeroDivisionError: a bug",
        None,
    )


def test_a_job_failure_in_a_multirun_is_its_record_not_an_exit(tmp_path, monkeypatch, capsys):
    def refused(*a):
        raise runner.JobFailed(EXIT_BAD_INPUT, "bad value")

    monkeypatch.setattr(runner, "_job", refused)
    job = sweep_job(tmp_path)
    assert runner.main({}, [], "", job).value is None
    assert capsys.readouterr().err == "pipeline: bad value\n"
    assert (record_of(tmp_path)["code"], record_of(tmp_path)["status"]) == (
        EXIT_BAD_INPUT,
        "failed",
    )
    # a single run: its outcome carries the exit code the entry exits with (job.main never exits)
    assert runner.main({}, [], "", None).code == EXIT_BAD_INPUT


def test_a_job_of_an_interrupted_sweep_that_never_started_is_recorded_and_shown_as_not_started(
    tmp_path, monkeypatch, capsys
):
    from pipeline.run.signals import SIGNALS_STATE
    from pipeline.sweep.summary import sweep_table

    monkeypatch.setattr(SIGNALS_STATE, "sweep_interrupted", lambda d: d == tmp_path)
    monkeypatch.setattr(runner, "_job", lambda *a: pytest.fail("a job of a stopped sweep started"))
    with pytest.raises(
        SweepInterrupted
    ):  # after its record: no sweeper asks for another job (Optuna's would)
        runner.main({}, [], "", sweep_job(tmp_path))
    r = record_of(tmp_path)
    assert (r["status"], r["code"]) == (
        "not started",
        EXIT_PREEMPTED,
    )  # the sweep's end still says interrupted
    assert "interrupted before this job started" in capsys.readouterr().err
    table = sweep_table(
        {"id": "abc", "swept": {"optimizer.lr": "0.1"}, "direction": "minimize"},
        {3: r},
        None,
        ["not tracked"],
    )
    assert table[0].endswith("1 jobs (1 not started), objective (min)") and table[2].split()[
        -2:
    ] == ["not", "started"]


def test_a_multirun_without_the_sweep_callback_records_nothing(tmp_path):
    SweepJob().record(1.0)
    assert SweepJob().tags is None and not list(tmp_path.iterdir())


def write_sweep(tmp_path, **kw) -> dict:
    sweep = {
        "id": "abc",
        "dir": str(tmp_path),
        "name": "k",
        "swept": {"optimizer.lr": "0.1,0.3"},
        "direction": "minimize",
        "objective": "best/val/loss",
        "status": "running",
        "job_offset": 5,
        **kw,
    }
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    return sweep


def hydra_cfg(num: int, sweep_dir=None):
    """A job's HydraConfig: with the sweep callback and its launcher's sweep directory (None: no callback)."""
    callbacks = (
        {}
        if sweep_dir is None
        else {"sweep": {"_target_": "pipeline.sweep.callback.SweepCallback"}}
    )
    task = OmegaConf.create(["experiment=k", "optimizer.lr=0.3"])  # Hydra's record, a ListConfig
    return types.SimpleNamespace(
        overrides=types.SimpleNamespace(task=task),
        job={"num": num},
        sweep=types.SimpleNamespace(dir=str(sweep_dir)),
        get={"callbacks": callbacks}.get,
    )


def test_the_job_is_read_from_its_sweeps_directory(tmp_path):
    write_sweep(tmp_path, uri="sqlite:///x.db")
    job = sweep_callback.job_of(hydra_cfg(2, tmp_path))
    assert (job.dir, job.sweep_id, job.num, job.name, job.parent, job.tracking_off) == (
        tmp_path,
        "abc",
        7,
        "optimizer.lr=0.3",
        {"sweep_id": "abc"},
        None,
    )  # 2 + the study's 5 trials before
    write_sweep(tmp_path, uri="sqlite:///x.db", tracking_off="the store is not a database")
    job = sweep_callback.job_of(hydra_cfg(0, tmp_path))
    assert (job.parent, job.tracking_off) == (None, "the store is not a database")
    write_sweep(tmp_path)  # tracking=none
    assert sweep_callback.job_of(hydra_cfg(0, tmp_path)).parent is None
    assert sweep_callback.job_of(hydra_cfg(0)).dir is None  # a multirun without the callback


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: None, "No such file or directory"),
        (lambda p: p.write_text('{"id": "abc", '), "sweep.json: "),
        (lambda p: p.write_text('["abc"]'), "not a sweep's record"),
        (lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
        (
            lambda p: p.write_text('{"id": "abc", "swept": {}, "job_offset": -3}'),
            "job_offset must be a non-negative",
        ),
        (
            lambda p: p.write_text('{"id": "abc", "swept": {}, "job_offset": "7"}'),
            "job_offset must be a non-negative",
        ),
    ],
)
def test_a_job_whose_sweep_json_cannot_be_read_fails_as_bad_input_in_one_line(
    tmp_path, monkeypatch, capsys, make, reason
):
    """Missing, damaged, not a sweep's record, a FIFO (never opened: it would block): the job's one line names
    the file, it is recorded as failed with exit 2, and nothing runs (was a traceback)."""
    make(tmp_path / "sweep.json")
    job = sweep_callback.job_of(hydra_cfg(2, tmp_path))
    monkeypatch.setattr(runner, "_job", lambda *a: pytest.fail("the job ran without its sweep"))
    outcome = runner.main({}, [], "", job)
    assert (outcome.value, outcome.code) == (None, EXIT_BAD_INPUT)
    err = capsys.readouterr().err
    assert (
        err.startswith(f"pipeline: {tmp_path / 'sweep.json'}: ")
        and reason in err
        and err.count("\n") == 1
    ), err
    r = record_of(tmp_path, 2)
    assert (r["status"], r["code"], r["overrides"]) == (
        "failed",
        EXIT_BAD_INPUT,
        ["experiment=k", "optimizer.lr=0.3"],
    )


def test_the_callback_reaches_its_jobs_without_its_pending_parent_request(tmp_path):
    from pipeline.tracking.link import Request
    from pipeline.tracking.sweep_parent import MlflowSweepParent

    callback = sweep_callback.SweepCallback()
    callback.sweep = {"id": "abc"}
    callback.parent = MlflowSweepParent(uri=f"sqlite:///{tmp_path}/m.db", experiment="e")
    callback.parent.request = Request()
    copy = pickle.loads(pickle.dumps(callback))  # as Hydra hands it to every job
    assert (
        copy.sweep == {"id": "abc"}
        and copy.parent.request is None
        and copy.parent.uri == callback.parent.uri
    )
    assert callback.parent.request is not None


def test_the_entry_point_ends_only_a_running_sweep_this_process_launched(
    tmp_path, monkeypatch, capsys
):
    import os
    import socket

    callback = sweep_callback.SweepCallback()
    assert not callback.end_unfinished("a single run")  # no sweep launched here
    callback.sweep = write_sweep(tmp_path, pid=os.getpid() + 1, host=socket.gethostname())
    assert not callback.end_unfinished("ValueError: x")  # another process's
    assert json.loads((tmp_path / "sweep.json").read_text())["status"] == "running"
    write_sweep(tmp_path, pid=os.getpid(), host=socket.gethostname())
    sweep_job(tmp_path, failure={"code": 1, "error": "boom"}).record()
    assert callback.end_unfinished("ValueError: x")
    ended = json.loads((tmp_path / "sweep.json").read_text())
    assert (ended["status"], ended["error"]) == ("failed", "ValueError: x") and ended[
        "ended_at"
    ] > 0
    assert not callback.end_unfinished("again")  # ended: once


def test_a_sweep_refused_before_any_job_leaves_no_sweep_and_no_directory_it_made(tmp_path):
    """Hydra refuses the jobs' overrides only after the sweep's start wrote sweep.json ("running") and
    multirun.yaml: the refusal undoes that start, so reindex finds no sweep that never ran."""
    from conftest import KERNODECK, refused_in_one_line, tree

    from pipeline.tracking.link import wait_idle

    out = tmp_path / "fresh" / "out"
    for tracking in ("tracking=none", "tracking=mlflow"):
        line = refused_in_one_line(
            ["-m", *KERNODECK, "optimizer.lrr=1e-3,3e-3", tracking, f"paths.output_dir={out}"],
            tmp_path,
        )
        assert "optimizer.lrr" in line
        wait_idle(
            f"sqlite:///{out}/mlflow.db"
        )  # a parent run started would be on its way: it must not be
        assert not (tmp_path / "fresh").exists()
    used = tmp_path / "used"
    (used / "sweeps" / "other").mkdir(parents=True)
    (used / "sweeps" / "other" / "sweep.json").write_text("{}")
    before = tree(used)
    refused_in_one_line(["-m", *KERNODECK, "model=mlp,bogus", f"paths.output_dir={used}"], tmp_path)
    assert tree(used) == before


def test_a_monitor_every_job_shares_refuses_the_sweep_before_it_starts(tmp_path):
    from conftest import KERNODECK, refused_in_one_line

    out = tmp_path / "out"
    line = refused_in_one_line(
        [
            "-m",
            *KERNODECK,
            "optimizer.lr=1e-3,3e-3",
            "stages.best_val.monitor=val/los",
            f"paths.output_dir={out}",
        ],
        tmp_path,
    )
    assert (
        line.startswith("pipeline: stages.best_val.monitor=val/los: ")
        and "did you mean val/loss?" in line
    )
    assert not out.exists()


def test_only_a_swept_key_check_monitors_reads_leaves_the_monitor_to_each_job():
    assert not sweep_callback.swept_monitor_inputs(["optimizer.lr", "model", "trainer.seed"])
    for key in (
        "stages.best_val.monitor",
        "+stages/early_stop",
        "data",
        "data.path",
        "trainer.grad_clip",
        "trainer",
        "optimized_metric",
        "experiment",
    ):
        assert sweep_callback.swept_monitor_inputs([key]), key


@pytest.mark.slow
def test_a_swept_monitor_fails_only_its_own_job_recorded_in_the_sweep(tmp_path):
    from conftest import KERNODECK, run_pipeline

    out = tmp_path / "out"
    proc = run_pipeline(
        ["-m", *KERNODECK, "stages.best_val.monitor=val/los,val/loss", f"paths.output_dir={out}"],
        tmp_path,
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    (sweep,) = (out / "sweeps").iterdir()
    jobs = {n: json.loads((sweep / "jobs" / f"{n}.json").read_text()) for n in (0, 1)}
    assert (jobs[0]["status"], jobs[0]["code"]) == (
        "failed",
        EXIT_BAD_INPUT,
    ) and "did you mean" in jobs[0]["error"]
    assert jobs[1]["status"] == "complete"
    assert json.loads((sweep / "sweep.json").read_text())["status"] == "failed"
