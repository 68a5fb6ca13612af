"""One job from a plain config: build it, hold its run directory, run its stages, exit with what happened.

Exit codes: 0 done (or already complete); 1 an error in the job (a non-finite loss, a bug); 2 bad input (a
value out of range, groups that do not fit, a busy run directory, a refused drift, an unusable checkpoint,
a planted symlink) -- one line on stderr, and nothing on disk changed; 75 preempted or interrupted: the
identical command continues.
"""
from __future__ import annotations

import logging
import logging.handlers
import math
import sys

from pipeline.atomic import UnsafePathError
from pipeline.checkpoint.errors import CheckpointError
from pipeline.job import build
from pipeline.run import DriftError, NonFiniteError, Run
from pipeline.rundir import RunBusyError, RunDir
from pipeline.schema import ConfigError
from pipeline.signals import SIGNALS_STATE

log = logging.getLogger("pipeline")
EXIT_ERROR, EXIT_BAD_INPUT = 1, 2


class JobFailed(Exception):
    """A job of a multirun that ended with an exit code: the sweep records it and goes on (one line)."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(message)


_MULTIRUN = False


def fail(code: int, message: object) -> None:
    print(f"pipeline: {message}", file=sys.stderr)
    if _MULTIRUN:
        raise JobFailed(code, str(message))
    sys.exit(code)


def objective(metrics: dict) -> float:
    return float(metrics.get("val/loss", math.nan))


def main(config: dict, overrides: list[str], config_yaml: str, multirun: bool = False) -> float:
    global _MULTIRUN
    _MULTIRUN = multirun
    try:
        job = build(config)
    except ConfigError as e:
        fail(EXIT_BAD_INPUT, e)
    rundir = RunDir(job.run_dir)
    log.info("run directory: %s", rundir.path)
    created = not rundir.path.exists()
    try:
        rundir.acquire()
    except (RunBusyError, UnsafePathError) as e:
        fail(EXIT_BAD_INPUT, e)
    # Log lines of the set-up wait in memory: a refused run must not write into the run's log.
    held = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    logging.getLogger().addHandler(held)
    file_handler = None
    try:
        SIGNALS_STATE.defer()
        run = Run(job, rundir, SIGNALS_STATE)
        try:
            run.setup()
        except (DriftError, CheckpointError, UnsafePathError) as e:
            if created:
                rundir.forget()
            fail(EXIT_BAD_INPUT, e)
        rundir.claim()
        rundir.write_hydra(config_yaml, overrides)
        file_handler = _log_file(rundir, held)
        try:
            code = run.execute()
        except (CheckpointError, UnsafePathError) as e:
            fail(EXIT_BAD_INPUT, e)
        except NonFiniteError as e:
            fail(EXIT_ERROR, e)
        if code:
            fail(code, f"preempted at step {job.state.step}; re-run the same command to resume")
        return objective(job.state.metrics)
    finally:
        logging.getLogger().removeHandler(held)
        if file_handler is not None:
            logging.getLogger().removeHandler(file_handler)
            file_handler.stream.close()
        rundir.release()


def _log_file(rundir: RunDir, held: logging.handlers.MemoryHandler) -> logging.Handler:
    """<run>/pipeline.log (never through a symlink), starting with the set-up lines held so far."""
    handler = logging.StreamHandler(rundir.open_log())
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    held.setTarget(handler)
    held.flush()
    logging.getLogger().removeHandler(held)
    logging.getLogger().addHandler(handler)
    return handler
