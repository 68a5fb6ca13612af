"""One job from a plain config, top to bottom: build it, hold its run directory, plan its history and apply the
plan, train, and return its Outcome; the entry (run/signals.run_command) turns it into the exit status."""

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
from pipeline.run.loop import Context, Outcome, Run
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
    """Run one job: its Outcome, whose line (a failure, a preemption) is said on stderr; a bug raises. A multirun's
    job (`sweep`) records its end in its sweep (an exception out of it too) and raises SweepInterrupted after it if
    its sweep was interrupted. `command`: the arguments that run it again, for its end summary (None: `overrides`)."""
    try:
        if sweep is not None:
            _start_in_sweep(sweep)
        again = list(overrides) if command is None else list(command)
        outcome = _job(config, overrides, config_yaml, sweep, again)
    except BaseException as e:
        if (ended := _ended(e)) is None:
            if sweep is not None:
                sweep.record(error=e)
            raise
        outcome = ended
    outcome = _requeued(outcome, sweep)
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


def _ended(e: BaseException) -> Outcome | None:
    """An exception's end of the job as an Outcome (None: a bug, its traceback)."""
    if isinstance(e, Interrupted):
        said = f"interrupted by {e} before the run started; nothing was changed; re-run the same command"
        e = JobFailed(EXIT_PREEMPTED, said, requeue=True, started=False)
    if (known := errors.exit_code(e) if isinstance(e, Exception) else None) is None:
        return None
    (code, message), status = known, "preempted" if known[0] == EXIT_PREEMPTED else "failed"
    requeue, started = getattr(e, "requeue", False), getattr(e, "started", True)
    return Outcome(status, code, message=message, requeue=requeue, started=started)


def _requeued(outcome: Outcome, sweep: SweepJob | None) -> Outcome:
    """A job a signal or its time budget stopped, inside a SLURM job, asks SLURM to requeue it (not when its sweep
    was stopped: its launcher ends it); requeued, its process ends at once, so submitit waits for the new run."""
    if not outcome.requeue or SIGNALS_STATE.sweep_interrupted(sweep.dir if sweep else None):
        return outcome
    if (slurm := requeue_self()) is None:
        return outcome
    requeued, said = slurm
    return replace(outcome, message=f"{outcome.message}\npipeline: {said}", requeued=requeued)


def _job(
    config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None, command: list[str]
) -> Outcome:
    """Build the job, hold its run directory, plan its history and apply the plan (signals stop it at once until
    then), claim the directory, train with signals deferred; the run directory is released at the end."""
    # Directories this command creates (the output directory, runs/, data/): removed again if a single run
    # ends without a run (refused, interrupted, failed) and they are still empty; nothing older is touched.
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
        # the set-up's lines wait: a refused run writes nothing into its log
        logging.getLogger().addHandler(held)
        started = (sweep and sweep.started) or time.time() - budget.process_age()
        context = Context(started, command, in_sweep=sweep is not None and sweep.dir is not None)
        applied = None
        try:
            planned = plan.plan(rundir, job, resume, started, context.in_sweep)
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
                raise JobFailed(
                    EXIT_PREEMPTED,
                    f"interrupted by {e} while setting up the run; {said}; re-run the same command",
                    requeue=True,
                ) from None
            raise
        run = Run(job, rundir, planned, SIGNALS_STATE, context)
        with SIGNALS_STATE.deferring():
            try:
                # a finished run's re-run changes nothing
                if not rundir.read_only and not planned.settled:
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
    """Validate, identity, assemble: the whole job, nothing under its run directory created; ConfigError (one
    line) for a bad value, a missing file, groups that clash, or the resume or training settings removed."""
    validate(config)
    plan.settings(config)
    # a fork is named by its origin too
    ident = identity.identify(config, plan.origin_of(config["resume"]["source"]))
    # before the tracker prepares: it makes the output directory and its store
    check_pairing(config)
    check_monitors(config)
    tracker = build_tracker(config, sweep)
    tracker.prepare()  # the tracking agent starts (or is found warm) while the data and the model are built
    try:
        job = assemble(config, ident)
    except (ValueError, OSError) as e:
        # a full or read-only disk while the corpus is made: not bad input
        if environment_error(e) is not None:
            raise
        raise ConfigError(str(e)) from None
    job.tracker, job.run_dir = tracker, Path(config["paths"]["runs_dir"]) / ident.name
    return job


def _start_in_sweep(sweep: SweepJob) -> None:
    """A multirun's job in a joblib or submitit worker: its own signals, its console lines labelled when jobs run
    side by side; refused if its sweep is unreadable or was interrupted before it started."""
    SIGNALS_STATE.install()
    if sweep.parallel:
        label_console(f"[job {sweep.num}]")
    if sweep.unreadable:
        raise JobFailed(errors.EXIT_BAD_INPUT, sweep.unreadable)
    if SIGNALS_STATE.sweep_interrupted(sweep.dir):
        said = "the sweep was interrupted before this job started; re-run the same command"
        raise JobFailed(EXIT_PREEMPTED, said, started=False)
    if SIGNALS_STATE.mode != SWEEP:
        SIGNALS_STATE.received = None  # a worker's earlier job was stopped; this one starts afresh


class JobLabel(logging.Formatter):
    """Each console line starts with its job's label (`[job 3] `): jobs side by side share one console."""

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
            fmt = handler.formatter
            handler.setFormatter(JobLabel(fmt.inner if isinstance(fmt, JobLabel) else fmt, label))
