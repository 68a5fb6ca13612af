"""One job from a plain config: build it, hold its run directory, plan and apply its history, train: an Outcome."""

from __future__ import annotations

import logging
import logging.handlers
import sys
import time
from dataclasses import replace
from pathlib import Path

from pipeline.config import errors, identity
from pipeline.config.errors import EXIT_ERROR, EXIT_PREEMPTED, CommandError, ConfigError
from pipeline.config.schemas import validate
from pipeline.files.atomic import NewDirs, check_output_dir, environment_error
from pipeline.run import budget, plan
from pipeline.run.assemble import Job, assemble, build_tracker, check_monitors, check_pairing
from pipeline.run.directory import RunDir
from pipeline.run.loop import Outcome, Run
from pipeline.run.signals import SIGNALS_STATE, SWEEP, Interrupted
from pipeline.run.slurm import requeue_self
from pipeline.run.sweep import SweepInterrupted, SweepJob
from pipeline.trainer.metrics_log import QuietFileHandler

log = logging.getLogger("pipeline")
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # pipeline.log's, as Hydra's


class JobFailed(CommandError):
    """A job's end around training (exit code, one line); `requeue`: a signal; `started`: its run had begun."""

    def __init__(self, code: int, message: str, requeue: bool = False, started: bool = True):
        super().__init__(message, exit_code=code)
        self.requeue, self.started = requeue, started


def main(
    config: dict,
    overrides: list[str],
    config_yaml: str,
    sweep: SweepJob | None = None,
    command: list[str] | None = None,
) -> Outcome:
    """Run one job: its Outcome, its line said on stderr; a bug raises. A `sweep` job records its end in its sweep,
    then raises SweepInterrupted if the sweep was; `command` runs it again (the end summary; None: `overrides`)."""
    try:
        if sweep is not None:  # a multirun's job: its own signals; refused if it cannot start
            SIGNALS_STATE.install()
            if sweep.parallel:
                label_console(f"[job {sweep.num}]")
            if sweep.unreadable:
                raise JobFailed(errors.EXIT_BAD_INPUT, sweep.unreadable)
            if SIGNALS_STATE.sweep_interrupted(sweep.dir):
                said = "the sweep was interrupted before this job started; re-run the same command"
                raise JobFailed(EXIT_PREEMPTED, said, started=False)
            if SIGNALS_STATE.mode != SWEEP:
                SIGNALS_STATE.received = None  # a worker's earlier job was stopped: not this one
        again = list(overrides) if command is None else list(command)
        outcome = _job(config, overrides, config_yaml, sweep, again)
    except BaseException as e:  # a known end of the job as an Outcome; a bug raises (its traceback)
        if isinstance(e, Interrupted):
            said = f"interrupted by {e} before the run started; nothing was changed; re-run the same command"
            e = JobFailed(EXIT_PREEMPTED, said, requeue=True, started=False)
        if (known := errors.exit_code(e) if isinstance(e, Exception) else None) is None:
            if sweep is not None:
                sweep.record(error=e)
            raise
        (code, message), status = known, "preempted" if known[0] == EXIT_PREEMPTED else "failed"
        requeue, started = getattr(e, "requeue", False), getattr(e, "started", True)
        outcome = Outcome(status, code, message=message, requeue=requeue, started=started)
    # stopped by a signal or its time budget inside SLURM: requeued (not a stopped sweep's: its launcher ends it)
    stopped = SIGNALS_STATE.sweep_interrupted(sweep.dir if sweep else None)
    if outcome.requeue and not stopped and (slurm := requeue_self()) is not None:
        requeued, said = slurm
        said = f"{outcome.message}\npipeline: {said}"
        outcome = replace(outcome, message=said, requeued=requeued)
    if outcome.message:
        print(f"pipeline: {outcome.message}", file=sys.stderr)
    if sweep is None or outcome.requeued:
        return outcome
    if outcome.code:  # the sweep goes on; its end says which jobs failed and why
        never = {} if outcome.started else {"status": "not started"}
        sweep.failure = {"code": outcome.code, "error": outcome.message[:2000], **never}
    sweep.record(None if outcome.code else outcome.objective)
    if sweep.failure is not None and SIGNALS_STATE.sweep_interrupted(sweep.dir):
        raise SweepInterrupted(f"job {sweep.num} stopped: the sweep was interrupted")
    return outcome


def _job(
    config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None, command: list[str]
) -> Outcome:
    """Build, hold the run directory, plan and apply (a signal stops it at once), claim, train (signals deferred)."""
    # the directories made here (output, runs/, data/): removed if a single run ends without one, still empty
    output = Path(config["paths"]["output_dir"])
    made = NewDirs(output, config["paths"]["runs_dir"], output / "data")
    check_output_dir(output)  # before anything is made (a link there: bad input)
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    job = rundir = file_handler = None
    try:
        job = build(config, sweep)
        resume, train = plan.settings(config)
        assert job.run_dir is not None  # build() names it
        rundir = RunDir(job.run_dir)
        if sweep is not None:
            sweep.run_dir = str(rundir.path)
        log.info("run directory: %s", rundir.path)
        rundir.acquire()
        logging.getLogger().addHandler(held)  # set-up's lines wait: a refused run logs nothing
        # a sweep job's own start (its siblings differ on purpose, its time is its own)
        own = sweep.started if sweep is not None and sweep.dir is not None else None
        started = own or time.time() - budget.process_age()
        applied = None
        try:
            planned = plan.plan(rundir, job, resume, started, own is not None)
            SIGNALS_STATE.check()  # one that came while a library call could not be cut short
            if rundir.read_only and not planned.complete:
                said = f"run directory {rundir.path} is on a read-only filesystem and the run"
                then = "make it writable (or copy it), then re-run the same command"
                raise JobFailed(EXIT_ERROR, f"{said} is not complete (nothing was written); {then}")
            applied = planned
            plan.apply(planned, rundir, job.state, SIGNALS_STATE)
            SIGNALS_STATE.check()
        except BaseException as e:
            rundir.forget()
            if isinstance(e, Interrupted):
                said = "nothing was written"
                if applied and (applied.supersede or applied.fallback or applied.cut):
                    said = f"the earlier history was moved to {rundir.path / 'superseded'}"
                why = (
                    f"interrupted by {e} while setting up the run; {said}; re-run the same command"
                )
                raise JobFailed(EXIT_PREEMPTED, why, requeue=True) from None
            raise
        run = Run(job, rundir, planned, command, own)
        with SIGNALS_STATE.deferring():
            try:
                if not rundir.read_only and not planned.settled:  # a settled run: nothing changes
                    file_handler = QuietFileHandler(rundir.claim(config_yaml, overrides))
                    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
                    held.setTarget(file_handler)
                    held.flush()  # the set-up's lines first
                    logging.getLogger().removeHandler(held)
                    logging.getLogger().addHandler(file_handler)
                outcome = run.execute(train.eval_every)
            except OSError as e:
                if (message := environment_error(e)) is None:
                    raise
                raise JobFailed(EXIT_ERROR, run.failure(message)) from None
            if sweep is not None:
                sweep.run_uri = job.facts.get("mlflow_run_uri")
            return outcome
    except BaseException:
        if sweep is None:
            made.prune()
        raise
    finally:
        if job is not None:
            job.state.runner.close()
        logging.getLogger().removeHandler(held)
        if file_handler is not None:
            logging.getLogger().removeHandler(file_handler)
            file_handler.close()
        if rundir is not None:
            rundir.release()


def build(config: dict, sweep: SweepJob | None = None) -> Job:
    """Validate, identity, assemble: the whole job, nothing under its run directory; ConfigError for bad input."""
    validate(config)
    plan.settings(config)
    # a fork is named by its origin too
    ident = identity.identify(config, plan.origin_of(config["resume"]["source"]))
    check_pairing(config)  # before the tracker prepares (it makes the output dir and store)
    check_monitors(config)
    tracker = build_tracker(config, sweep)
    tracker.prepare()  # the tracking agent starts (or is found warm) while the data and the model are built
    try:
        job = assemble(config, ident)
    except (ValueError, OSError) as e:
        if environment_error(e) is not None:  # a full or read-only disk: not bad input
            raise
        raise ConfigError(str(e)) from None
    job.tracker, job.run_dir = tracker, Path(config["paths"]["runs_dir"]) / ident.name
    return job


class JobLabel(logging.Formatter):
    """Each console line starts with its job's label (`[job 3] `): jobs side by side share one console."""

    def __init__(self, inner: logging.Formatter | None, label: str):
        super().__init__()
        self.inner, self.label = inner or logging.Formatter(), label

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(f"{self.label} {line}" for line in self.inner.format(record).split("\n"))


def label_console(label: str) -> None:
    """The root logger's console handlers start each line with `label` (a run's pipeline.log stays as it is)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, QuietFileHandler):
            fmt = handler.formatter
            handler.setFormatter(JobLabel(fmt.inner if isinstance(fmt, JobLabel) else fmt, label))
