"""One job from a plain config: build it, hold its run directory, run its stages, exit with what happened
(docs/stages.md: Exit codes)."""
from __future__ import annotations

import logging
import logging.handlers
import math
import sys
import time
from pathlib import Path
from typing import NoReturn

from pipeline.run import budget
from pipeline.files.atomic import NewDirs, UnsafePathError, environment_error
from pipeline.checkpoint.errors import CheckpointError
from pipeline.run.assemble import build
from pipeline.run.loop import NonFiniteError, Run
from pipeline.stages.drift import DriftError
from pipeline.run.directory import RunBusyError, RunDir
from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED, ConfigError
from pipeline.run.signals import SIGNALS_STATE, SWEEP, Interrupted
from pipeline.run.slurm import requeue_self
from pipeline.run.sweep import SweepJob
from pipeline.trainer.metrics_log import QuietFileHandler

log = logging.getLogger("pipeline")


class JobFailed(Exception):
    """A job that ends with an exit code: a single run exits with it; a multirun's sweep records it and goes
    on. `requeue`: stopped by a signal or its time budget; `started`: False if it stopped before its run began."""

    def __init__(self, code: int, message: str, requeue: bool = False, started: bool = True):
        self.code, self.requeue, self.started = code, requeue, started
        super().__init__(message)


def fail(code: int, message: object, requeue: bool = False, started: bool = True) -> None:
    raise JobFailed(code, str(message), requeue, started)


def _failed(e: JobFailed, sweep: SweepJob | None) -> float:
    """One line on stderr; a single run exits with the code, a multirun's job records it. A `requeue` inside a
    SLURM job requeues it and exits rather than returns, so submitit waits for the requeued job (not when its
    sweep was stopped: its launcher is ending the sweep)."""
    print(f"pipeline: {e}", file=sys.stderr)
    requeue = e.requeue and not SIGNALS_STATE.sweep_interrupted(sweep.dir if sweep is not None else None)
    if requeue and (slurm := requeue_self()) is not None:
        requeued, said = slurm
        print(f"pipeline: {said}", file=sys.stderr)
        if requeued:
            sys.exit(e.code)
    if sweep is None:
        sys.exit(e.code)
    sweep.failure = {"code": e.code, "error": str(e)[:2000], **({} if e.started else {"status": "not started"})}
    return math.nan  # the sweep goes on; its end says which jobs failed and why


def objective(job, name: str | None) -> float:
    """What a sweeper optimises: `optimized_metric` (null: the best value of the best-val stage's monitor)."""
    if name is None:
        best = [s.best for s in job.stages if getattr(s, "link", None) == "best" and hasattr(s, "best")]
        return float(best[0]) if best and best[0] is not None else math.nan
    return float(job.state.metrics.get(name, math.nan))


def main(config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None = None,
         command: list[str] | None = None) -> float:
    """Run one job; its objective, or (a single run) the process exits with a code other than 0. A multirun's
    job (`sweep`) records itself in its sweep at its end, an exception out of it included. `command`: the
    arguments that run it again (Hydra's config flags, the search path, the overrides) for its end summary;
    None: `overrides`."""
    command = list(overrides) if command is None else list(command)
    if sweep is None:
        try:
            return _main(config, overrides, config_yaml, None, command)
        except JobFailed as e:
            return _failed(e, None)
    try:
        value = _multirun(config, overrides, config_yaml, sweep, command)
    except Exception as e:
        sweep.record(error=e)
        raise
    sweep.record(value)
    return value


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
            inner = handler.formatter.inner if isinstance(handler.formatter, JobLabel) else handler.formatter
            handler.setFormatter(JobLabel(inner, label))


def _multirun(config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob, command: list[str]) -> float:
    try:
        SIGNALS_STATE.install()  # a joblib or submitit worker: this job's own signals
        if sweep.parallel:
            label_console(f"[job {sweep.num}]")
        if sweep.unreadable:
            fail(EXIT_BAD_INPUT, sweep.unreadable)
        if SIGNALS_STATE.sweep_interrupted(sweep.dir):
            fail(EXIT_PREEMPTED, "the sweep was interrupted before this job started; re-run the same command",
                 started=False)
        if SIGNALS_STATE.mode != SWEEP:
            SIGNALS_STATE.received = None  # a worker's earlier job was stopped; this one starts afresh
        return _main(config, overrides, config_yaml, sweep, command)
    except JobFailed as e:
        return _failed(e, sweep)
    except Interrupted as e:
        return _failed(JobFailed(EXIT_PREEMPTED, f"interrupted by {e} before the run started", requeue=True,
                                 started=False), sweep)


def _main(config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None, command: list[str]) -> float:
    # Directories this command creates (the output directory, runs/, data/): removed again if the command
    # ends without a run (refused, interrupted, failed) and they are still empty; nothing older is touched.
    made = NewDirs(config["paths"]["output_dir"], config["paths"]["runs_dir"],
                   Path(config["paths"]["output_dir"]) / "data")
    try:
        return _job(config, overrides, config_yaml, sweep, command)
    except BaseException:
        if sweep is None:
            made.prune()
        raise


def _job(config: dict, overrides: list[str], config_yaml: str, sweep: SweepJob | None, command: list[str]) -> float:
    try:
        job = build(config, sweep)
    except ConfigError as e:
        fail(EXIT_BAD_INPUT, e)
    except OSError as e:
        _environment(e)
    rundir = RunDir(job.run_dir)
    if sweep is not None:
        sweep.run_dir = str(rundir.path)
    log.info("run directory: %s", rundir.path)
    created = not rundir.path.exists()
    try:
        rundir.acquire()
    except (RunBusyError, UnsafePathError) as e:
        fail(EXIT_BAD_INPUT, e)
    except OSError as e:
        _environment(e)
    # Log lines of the set-up wait in memory: a refused run must not write into the run's log.
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    logging.getLogger().addHandler(held)
    file_handler = None
    try:
        started = (sweep and sweep.started) or time.time() - budget.process_age()  # a job's, or this process's
        run = Run(job, rundir, SIGNALS_STATE, started=started, overrides=command,
                  in_sweep=sweep is not None and sweep.dir is not None)
        try:
            run.setup()  # a signal here stops the process at once: set-up writes nothing but supersede()
            if SIGNALS_STATE.received is not None:  # one that came while a step could not be cut short
                raise Interrupted(SIGNALS_STATE.received)
        except (DriftError, CheckpointError, UnsafePathError) as e:
            if created:
                rundir.forget()
            fail(EXIT_BAD_INPUT, e)
        except Interrupted as e:
            if created:
                rundir.forget()
            moved = f"; the earlier history was moved to {run.superseded}" if run.superseded else \
                "; nothing was written"
            fail(EXIT_PREEMPTED, f"interrupted by {e} while setting up the run{moved}; re-run the same command",
                 requeue=True)
        except OSError as e:
            _environment(e)
        if rundir.read_only and not run.complete:
            fail(EXIT_ERROR, f"run directory {rundir.path} is on a read-only filesystem and the run is not "
                             "complete (nothing was written); make it writable (or copy it), then re-run the same "
                             "command")
        with SIGNALS_STATE.deferring():
            try:
                if not rundir.read_only and not run.settled():  # a finished run's re-run changes no file of it
                    try:
                        rundir.claim()
                        rundir.write_hydra(config_yaml, overrides)
                    except OSError:
                        if created:
                            rundir.forget()
                        raise
                    file_handler = _log_file(rundir, held)
                code = run.execute()
            except (CheckpointError, UnsafePathError) as e:
                fail(EXIT_BAD_INPUT, e)
            except NonFiniteError as e:
                fail(EXIT_ERROR, e)
            except OSError as e:
                said = "; run.json says failed" if rundir.read_status().get("status") == "failed" else ""
                kept = rundir.store.steps()
                _environment(e, said + (f"; the run continues from its checkpoint of step {kept[-1][0]}" if kept
                                        else ""))
            if sweep is not None:
                sweep.run_uri = job.facts.get("mlflow_run_uri")
            if code:
                fail(code, f"preempted at step {job.state.step}; re-run the same command to resume", requeue=True)
            return objective(job, config.get("optimized_metric"))
    finally:
        job.state.close()
        logging.getLogger().removeHandler(held)
        if file_handler is not None:
            logging.getLogger().removeHandler(file_handler)
            file_handler.close()
        rundir.release()


def _environment(e: OSError, note: str = "") -> NoReturn:
    """A full disk, a read-only or forbidden place: one line and EXIT_ERROR (anything else raised on: its traceback)."""
    if (message := environment_error(e)) is not None:
        fail(EXIT_ERROR, message + note)
    raise e


def _log_file(rundir: RunDir, held: logging.handlers.MemoryHandler) -> logging.Handler:
    """<run>/pipeline.log (never through a symlink), starting with the set-up lines held so far."""
    handler = QuietFileHandler(rundir.open_log())
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    held.setTarget(handler)
    held.flush()
    logging.getLogger().removeHandler(held)
    logging.getLogger().addHandler(handler)
    return handler
