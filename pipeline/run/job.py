"""One job from a plain config: build it, hold its run directory, run its stages, exit with what happened.

Exit codes: 0 done (or already complete); 1 an error in the job (a non-finite loss, a bug) or of the machine
(a full disk, a read-only or forbidden place: one line naming the path, run.json saying failed); 2 bad input (a
value out of range, groups that do not fit, a busy run directory, a refused drift, an unusable checkpoint,
a planted symlink) -- one line on stderr, and nothing on disk changed; 75 preempted or interrupted: the
identical command continues.
"""
from __future__ import annotations

import logging
import logging.handlers
import math
import sys
import time
from pathlib import Path

from pipeline.run import budget
from pipeline.files.atomic import NewDirs, UnsafePathError, environment_error
from pipeline.checkpoint.errors import CheckpointError
from pipeline.run.assemble import build
from pipeline.run.loop import DriftError, NonFiniteError, Run
from pipeline.run.directory import RunBusyError, RunDir
from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED, ConfigError
from pipeline.run.signals import SIGNALS_STATE, SWEEP, Interrupted
from pipeline.run.slurm import requeue_self
from pipeline.tracking.common import CURRENT_JOB
from pipeline.trainer.metrics_log import QuietFileHandler

log = logging.getLogger("pipeline")


class JobFailed(Exception):
    """A job of a multirun that ended with an exit code: its sweep records it and goes on with the others."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(message)


_MULTIRUN = False


def fail(code: int, message: object, requeue: bool = False) -> None:
    """One line on stderr, and the exit code: at once for a single run; for a multirun job, its failure.

    A run stopped by a signal or its time budget (`requeue`) inside a SLURM job makes sure the job runs again
    (pipeline.run.slurm); the process then exits rather than returning, so submitit waits for the requeued job.
    (Not a job whose sweep was stopped: its launcher is ending the sweep, and the identical command
    continues it.)"""
    print(f"pipeline: {message}", file=sys.stderr)
    sweep_dir = CURRENT_JOB.get("sweep_dir") if _MULTIRUN else None
    if SIGNALS_STATE.sweep_interrupted(sweep_dir):
        requeue = False  # its sweep's launcher stopped it: requeued, it would only be held back again
    if requeue and (slurm := requeue_self()) is not None:
        requeued, said = slurm
        print(f"pipeline: {said}", file=sys.stderr)
        if requeued:
            sys.exit(code)
    if _MULTIRUN:
        CURRENT_JOB["failure"] = {"code": code, "error": str(message)[:2000]}
        raise JobFailed(code, str(message))
    sys.exit(code)


def objective(job, name: str | None) -> float:
    """What a sweeper optimises: `optimized_metric` (null: the best value of the best-val stage's monitor)."""
    if name is None:
        best = [s.best for s in job.stages if getattr(s, "link", None) == "best" and hasattr(s, "best")]
        return float(best[0]) if best and best[0] is not None else math.nan
    return float(job.state.metrics.get(name, math.nan))


def main(config: dict, overrides: list[str], config_yaml: str, multirun: bool = False) -> float:
    """Run one job; its objective, or (a single run) the process exits with a code other than 0."""
    global _MULTIRUN
    _MULTIRUN = multirun
    try:
        if multirun:
            sweep_dir = CURRENT_JOB.get("sweep_dir")
            SIGNALS_STATE.install()  # a joblib or submitit worker: this job's own signals
            if SIGNALS_STATE.sweep_interrupted(sweep_dir):
                fail(EXIT_PREEMPTED, "the sweep was interrupted before this job started; re-run the same command")
            if SIGNALS_STATE.mode != SWEEP:
                SIGNALS_STATE.received = None  # a worker's earlier job was stopped; this one starts afresh
        return _main(config, overrides, config_yaml)
    except JobFailed:
        return math.nan  # the sweep goes on; its end says which jobs failed and why
    except Interrupted as e:
        if not multirun:
            raise
        try:
            fail(EXIT_PREEMPTED, f"interrupted by {e} before the run started", requeue=True)
        except JobFailed:
            return math.nan


def _main(config: dict, overrides: list[str], config_yaml: str) -> float:
    # Directories this command creates (the output directory, runs/, data/): removed again if the command
    # ends without a run (refused, interrupted, failed) and they are still empty; nothing older is touched.
    made = NewDirs(config["paths"]["output_dir"], config["paths"]["runs_dir"],
                   Path(config["paths"]["output_dir"]) / "data")
    try:
        return _job(config, overrides, config_yaml)
    except BaseException:
        if not _MULTIRUN:
            made.prune()
        raise


def _job(config: dict, overrides: list[str], config_yaml: str) -> float:
    try:
        job = build(config)
    except ConfigError as e:
        fail(EXIT_BAD_INPUT, e)
    except OSError as e:
        _environment(e)
        raise
    rundir = RunDir(job.run_dir)
    CURRENT_JOB["run_dir"] = str(rundir.path)
    log.info("run directory: %s", rundir.path)
    created = not rundir.path.exists()
    try:
        rundir.acquire()
    except (RunBusyError, UnsafePathError) as e:
        fail(EXIT_BAD_INPUT, e)
    except OSError as e:
        _environment(e)
        raise
    # Log lines of the set-up wait in memory: a refused run must not write into the run's log.
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    logging.getLogger().addHandler(held)
    file_handler = None
    try:
        started = CURRENT_JOB.get("started") or time.time() - budget.process_age()  # a job's, or this process's
        run = Run(job, rundir, SIGNALS_STATE, started=started, overrides=overrides)
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
            raise
        if rundir.read_only and not run.complete:
            fail(EXIT_ERROR, f"run directory {rundir.path} is on a read-only filesystem and the run is not "
                             "complete (nothing was written); make it writable (or copy it), then re-run the same "
                             "command")
        with SIGNALS_STATE.deferring():
            try:
                if not rundir.read_only:
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
                raise
            CURRENT_JOB["run_uri"] = job.facts.get("mlflow_run_uri")
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


def _environment(e: OSError, note: str = "") -> None:
    """A full disk, a read-only or forbidden place: one line and EXIT_ERROR (anything else: its traceback)."""
    if (message := environment_error(e)) is not None:
        fail(EXIT_ERROR, message + note)


def _log_file(rundir: RunDir, held: logging.handlers.MemoryHandler) -> logging.Handler:
    """<run>/pipeline.log (never through a symlink), starting with the set-up lines held so far."""
    handler = QuietFileHandler(rundir.open_log())
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    held.setTarget(handler)
    held.flush()
    logging.getLogger().removeHandler(held)
    logging.getLogger().addHandler(handler)
    return handler
