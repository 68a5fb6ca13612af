"""One job from a plain config, top to bottom: validate, identity, assemble (build), hold its run directory, run
its stages, exit with what happened (docs/stages.md: Exit codes)."""

from __future__ import annotations

import logging
import logging.handlers
import math
import sys
import time
from pathlib import Path

from pipeline.config import identity
from pipeline.config.errors import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_PREEMPTED,
    CommandError,
    ConfigError,
    exit_code,
)
from pipeline.config.schemas import validate
from pipeline.files.atomic import NewDirs, check_output_dir, environment_error
from pipeline.run import budget
from pipeline.run.assemble import Job, assemble, build_tracker, check_monitors, check_pairing
from pipeline.run.directory import RunDir
from pipeline.run.loop import Run
from pipeline.run.signals import SIGNALS_STATE, SWEEP, Interrupted
from pipeline.run.slurm import requeue_self
from pipeline.run.sweep import SweepInterrupted, SweepJob
from pipeline.stages.resume import origin_of
from pipeline.trainer.metrics_log import QuietFileHandler

log = logging.getLogger("pipeline")


class JobFailed(CommandError):
    """A job's end with its exit code and one line; `requeue`: stopped by a signal or its time budget;
    `started`: False if it stopped before its run began."""

    def __init__(self, code: int, message: str, requeue: bool = False, started: bool = True):
        super().__init__(message, exit_code=code)
        self.requeue, self.started = requeue, started


def main(
    config: dict,
    overrides: list[str],
    config_yaml: str,
    sweep: SweepJob | None = None,
    command: list[str] | None = None,
) -> float | None:
    """Run one job; its objective, None if it has none (a sweeper told NaN refuses it: Optuna's then fails in its
    own error path). A failure that carries an exit code is one line on stderr: a single run exits with the code,
    a multirun's job (`sweep`) records it and returns None (the sweep goes on), or raises SweepInterrupted if its
    sweep was interrupted (no sweeper asks for another job); its end is recorded in its sweep, an exception out
    of it included. `command`: the arguments that run it again (Hydra's config flags, the search path, the
    overrides) for its end summary; None: `overrides`."""
    try:
        if sweep is not None:
            _start_in_sweep(sweep)
        value = _job(
            config,
            overrides,
            config_yaml,
            sweep,
            list(overrides) if command is None else list(command),
        )
    except BaseException as e:
        if (failed := _failed(e, sweep)) is None:
            if sweep is not None:
                sweep.record(error=e)
            raise
        print(f"pipeline: {failed}", file=sys.stderr)
        if sweep is None:
            sys.exit(failed.exit_code)
        sweep.failure = {
            "code": failed.exit_code,
            "error": str(failed)[:2000],
            **({} if failed.started else {"status": "not started"}),
        }
        value = None  # the sweep goes on; its end says which jobs failed and why
    if sweep is not None:
        sweep.record(value)
        if sweep.failure is not None and SIGNALS_STATE.sweep_interrupted(sweep.dir):
            raise SweepInterrupted(f"job {sweep.num} stopped: the sweep was interrupted")
    return None if value is None or math.isnan(value) else value


class JobLabel(logging.Formatter):
    """A console formatter that starts each line of a record with its job's label (`[job 3] `): jobs that run
    side by side (joblib) write to one console."""

    def __init__(self, inner: logging.Formatter | None, label: str):
        super().__init__()
        self.inner, self.label = inner or logging.Formatter(), label

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(f"{self.label} {line}" for line in self.inner.format(record).split("\n"))


def label_console(label: str) -> None:
    """The root logger's console handlers (Hydra's, set up for each job; a worker's next job relabels them) start
    each line with `label`; a run's pipeline.log is its own and stays as it is."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, QuietFileHandler):
            inner = (
                handler.formatter.inner
                if isinstance(handler.formatter, JobLabel)
                else handler.formatter
            )
            handler.setFormatter(JobLabel(inner, label))


def _start_in_sweep(sweep: SweepJob) -> None:
    """A multirun's job in a joblib or submitit worker: its own signals, its console lines labelled when jobs run
    side by side; refused if its sweep is unreadable or was interrupted before it started."""
    SIGNALS_STATE.install()
    if sweep.parallel:
        label_console(f"[job {sweep.num}]")
    if sweep.unreadable:
        raise JobFailed(EXIT_BAD_INPUT, sweep.unreadable)
    if SIGNALS_STATE.sweep_interrupted(sweep.dir):
        raise JobFailed(
            EXIT_PREEMPTED,
            "the sweep was interrupted before this job started; re-run the same command",
            started=False,
        )
    if SIGNALS_STATE.mode != SWEEP:
        SIGNALS_STATE.received = None  # a worker's earlier job was stopped; this one starts afresh


def _failed(e: BaseException, sweep: SweepJob | None) -> JobFailed | None:
    """The job's end as a JobFailed (None: a bug, its traceback). A `requeue` inside a SLURM job requeues it and
    exits at once, so submitit waits for the requeued job (not when its sweep was stopped: its launcher ends it)."""
    if isinstance(e, Interrupted):
        e = JobFailed(
            EXIT_PREEMPTED,
            f"interrupted by {e} before the run started; nothing was changed; re-run "
            "the same command",
            requeue=True,
            started=False,
        )
    elif not isinstance(e, JobFailed):
        known = exit_code(e) if isinstance(e, Exception) else None
        if known is None:
            return None
        e = JobFailed(*known)
    if (
        e.requeue
        and not SIGNALS_STATE.sweep_interrupted(sweep.dir if sweep is not None else None)
        and (slurm := requeue_self()) is not None
    ):
        requeued, said = slurm
        if requeued:
            print(f"pipeline: {e}\npipeline: {said}", file=sys.stderr)
            sys.exit(e.exit_code)
        e = JobFailed(e.exit_code, f"{e}\npipeline: {said}", started=e.started)
    return e


def build(config: dict, sweep: SweepJob | None = None) -> Job:
    """Validate, identity, assemble: the whole job, nothing under its run directory created; ConfigError (one line)
    for a bad value, a missing file, or groups that clash."""
    validate(config)
    ident = identity.identify(
        config, origin_of(config["resume"]["source"])
    )  # a fork is named by its origin too
    check_pairing(
        config
    )  # before the tracker prepares: it makes the output directory and its store
    check_monitors(config)
    tracker = build_tracker(config, sweep)
    tracker.prepare()  # the tracking agent starts (or is found warm) while the data and the model are built
    try:
        job = assemble(config, ident)
    except (ValueError, OSError) as e:
        if (
            environment_error(e) is not None
        ):  # a full or read-only disk while the corpus is made: not bad input
            raise
        raise ConfigError(str(e)) from None
    job.tracker, job.run_dir = tracker, Path(config["paths"]["runs_dir"]) / ident.name
    return job


def _job(
    config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None, command: list[str]
) -> float:
    """The job in one line: build it, hold its run directory, set its stages up, claim the directory, run it with
    signals deferred, its objective; the run directory is released at the end."""
    # Directories this command creates (the output directory, runs/, data/): removed again if a single run
    # ends without a run (refused, interrupted, failed) and they are still empty; nothing older is touched.
    made = NewDirs(
        config["paths"]["output_dir"],
        config["paths"]["runs_dir"],
        Path(config["paths"]["output_dir"]) / "data",
    )
    check_output_dir(
        Path(config["paths"]["output_dir"])
    )  # before anything is made (a link there: bad input)
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    job = rundir = file_handler = None
    try:
        job = build(config, sweep)
        assert job.run_dir is not None  # build() names it
        rundir = RunDir(job.run_dir)
        if sweep is not None:
            sweep.run_dir = str(rundir.path)
        log.info("run directory: %s", rundir.path)
        rundir.acquire()
        logging.getLogger().addHandler(
            held
        )  # the set-up's lines wait: a refused run writes nothing into its log
        started = (
            sweep and sweep.started
        ) or time.time() - budget.process_age()  # a job's, or this process's
        run = Run(
            job,
            rundir,
            SIGNALS_STATE,
            started=started,
            overrides=command,
            in_sweep=sweep is not None and sweep.dir is not None,
        )
        try:
            run.setup()  # a signal here stops the process at once: set-up writes nothing but supersede()
            if (
                SIGNALS_STATE.received is not None
            ):  # one that came while a step could not be cut short
                raise Interrupted(SIGNALS_STATE.received)
            if rundir.read_only and not run.complete:
                raise JobFailed(
                    EXIT_ERROR,
                    f"run directory {rundir.path} is on a read-only filesystem and the run "
                    "is not complete (nothing was written); make it writable (or copy it), "
                    "then re-run the same command",
                )
        except BaseException as e:
            rundir.forget()
            if isinstance(e, Interrupted):
                moved = (
                    f"; the earlier history was moved to {run.superseded}"
                    if run.superseded
                    else "; nothing was written"
                )
                raise JobFailed(
                    EXIT_PREEMPTED,
                    f"interrupted by {e} while setting up the run{moved}; re-run the same command",
                    requeue=True,
                ) from None
            raise
        with SIGNALS_STATE.deferring():
            try:
                if (
                    not rundir.read_only and not run.settled()
                ):  # a finished run's re-run changes no file of it
                    file_handler = QuietFileHandler(rundir.claim(config_yaml, overrides))
                    file_handler.setFormatter(
                        logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
                    )
                    held.setTarget(file_handler)
                    held.flush()  # the set-up's lines first
                    logging.getLogger().removeHandler(held)
                    logging.getLogger().addHandler(file_handler)
                code, value = run.execute()
            except OSError as e:
                if (message := environment_error(e)) is None:
                    raise
                raise JobFailed(EXIT_ERROR, run.failure(message)) from None
            if sweep is not None:
                sweep.run_uri = job.facts.get("mlflow_run_uri")
            if code:
                raise JobFailed(
                    code, f"preempted at step {job.state.step}; {run.resume_hint()}", requeue=True
                )
            return value
    except BaseException:
        if sweep is None:
            made.prune()
        raise
    finally:
        if job is not None:
            job.state.close()
        logging.getLogger().removeHandler(held)
        if file_handler is not None:
            logging.getLogger().removeHandler(file_handler)
            file_handler.close()
        if rundir is not None:
            rundir.release()
