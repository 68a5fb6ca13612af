"""One job in its run directory, continuing its plan's history: train, checkpoint, retain, end as an Outcome."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.retention import AnyOf, LatestN
from pipeline.config import identity
from pipeline.config.checks import parse_duration
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, EXIT_PREEMPTED, CommandError
from pipeline.files.atomic import environment_error, named
from pipeline.model.minigpt import release_freed_memory
from pipeline.run import budget, report
from pipeline.run.assemble import Job
from pipeline.run.directory import RunDir
from pipeline.run.plan import NEVER, Plan, continued_by, written_now
from pipeline.run.signals import SIGNALS_STATE
from pipeline.stages.base import StepEnd
from pipeline.stateful import capture
from pipeline.trainer import curves
from pipeline.trainer.display import Display
from pipeline.trainer.loop import epochs_done, fit, metrics_of
from pipeline.trainer.metrics_log import MetricsLog
from pipeline.trainer.phases import Profile

log = logging.getLogger("pipeline")


class NonFiniteError(CommandError):
    """A non-finite training loss or validation metric with trainer.on_nonfinite=stop."""

    exit_code = EXIT_ERROR


@dataclass(frozen=True)
class Outcome:
    """How a job ended (complete, preempted, failed), its exit code, objective and line on stderr."""

    status: str
    code: int
    objective: float = math.nan
    message: str = ""
    requeue: bool = False  # a signal or the time budget stopped it (SLURM may requeue it)
    started: bool = True  # its run had begun
    requeued: bool = False  # SLURM requeues the job: its process ends at once

    @property
    def value(self) -> float | None:
        """What a sweeper is told: None for a job without an objective (told NaN, Optuna refuses it)."""
        return None if self.code or math.isnan(self.objective) else self.objective


class Run:
    """A job continuing its plan's history (8 attributes); `command` runs it again, `started`: a sweep job's start."""

    def __init__(self, job: Job, rundir: RunDir, plan: Plan, command: list, started: float | None):
        self.job, self.rundir, self.plan = job, rundir, plan
        self.command, self.started = command, started
        max_time = job.config["trainer"].get("max_time")
        self.budget = budget.Budget(None if max_time is None else parse_duration(max_time))
        self.profile = Profile(job.config["trainer"].get("profile"))  # absent from older configs
        self.stopped: str | None = None  # what preempted the run: a signal, or trainer.max_time
        if plan.allowed:
            job.facts["allowed_changes"] = plan.allowed

    @property
    def state(self):
        return self.job.state

    @property
    def store(self):
        return self.rundir.store  # a new object once a history moves aside

    def train(self, eval_every: int) -> None:
        trainer = self.job.config["trainer"]
        sink = partial(self._handover, self.job.tracker.log_line)  # each line to the tracker, timed
        callbacks: list[MetricsLog | Display] = [
            MetricsLog(self.rundir.open_metrics, trainer["log_every"], sinks=[sink]),
            Display(trainer["progress_bar"], trainer["log_every"]),
        ]
        try:
            self.budget.start()
            fit(self.state, eval_every, self.step_end, callbacks, self.profile)
        finally:
            for cb in callbacks:
                cb.close()

    def _handover(self, call, *args, **kwargs):
        """A call of the tracker, timed as trainer.profile's `tracking hand-over`."""
        with self.profile.phase("tracking hand-over"):
            return call(*args, **kwargs)

    def step_end(self, record: dict) -> bool:
        """The one decision after every update: stop?, checkpoint (who asked)?, preempted? True ends training."""
        metrics, trainer = metrics_of(record), self.job.config["trainer"]
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad and trainer["on_nonfinite"] == "stop":
            said = f"step {record['step']}: {bad[0]} is {metrics[bad[0]]} (non-finite); stopping"
            then = "with the last good checkpoints kept (trainer.on_nonfinite=continue trains on)"
            raise NonFiniteError(f"{said} {then}")
        state, epochs = self.state, epochs_done(self.state)
        last = state.step >= state.total_steps
        end = StepEnd(state.step, metrics, epochs > record["epoch"], epochs, last)
        # every stage sees every step end (a stateful one must not miss the step another stops on)
        stop = next((r for r in [s.stop_reason(end) for s in self.job.stages] if r), None)
        end = replace(end, last=last or bool(stop))
        if end.last:
            self.state.progress.ended = stop or "max_steps"
        tags = [s.name for s in self.job.stages if s.wants_checkpoint(end)]
        # A spent trainer.max_time is a preemption announced in advance: checkpoint now, exit 75, requeue.
        preempted = self.budget.step_ended() or SIGNALS_STATE.received is not None
        if tags or preempted or end.last:
            self.checkpoint(metrics, tags, final=end.last or preempted)
        if preempted and not end.last:
            self.stopped = SIGNALS_STATE.name or f"trainer.max_time={trainer['max_time']}"
        return end.last or preempted

    def checkpoint(self, metrics: dict, tags: list[str], final: bool = False) -> Checkpoint:
        tracker = self.job.tracker
        # only the last save waits for the tracked run's URI; earlier manifests carry it once it is known
        wait = 30.0 if final else 0.0
        self.job.facts["mlflow_run_uri"] = self._handover(tracker.run_uri, timeout=wait)
        with self.profile.phase("checkpoint"):
            at = {"step": self.state.step, "epoch": self.state.epoch, "lineage": self.plan.lineage}
            fields = mf.build(self.job.facts, metrics=metrics, tags=tags, **at)
            started = budget.monotonic()
            try:
                ckpt = self.store.save(self.state.step, capture(self.job.parts), fields)
            except OSError as e:  # a write inside the temporary checkpoint: name the store
                raise named(e, self.store.root) from e
            self.retain()
            self.budget.saved(budget.monotonic() - started)
        self._handover(tracker.log_checkpoint, ckpt.directory, ckpt.manifest)
        return ckpt

    def retain(self) -> None:
        """Keep what every stage's policy, the newest checkpoint and checkpoints/' links keep; prune the rest."""
        stages = self.job.stages
        keep = AnyOf((*tuple(p for s in stages if (p := s.policy()) is not None), LatestN(1)))
        links = {s.link: s.link_policy() for s in stages if s.link}
        named = tuple(n for s in stages if (n := s.named()) is not None)
        self.store.retain(keep, links, self.state.step, self.plan.lineage["id"], named)

    def write_status(self, status: str, **extra) -> None:
        if status != "running":
            extra["ended_at"] = time.time()
        state, facts = self.state, self.job.facts
        fields = {k: getattr(state, k) for k in ("step", "total_steps", "epoch", "metrics")}
        fields.update(status=status, ended=state.progress.ended, **self.plan.history, **extra)
        fields.update({k: facts[k] for k in ("config_hash", "data_manifest_hash")})
        self.rundir.write_status(status != "running", **fields)

    def _failed(self, error: str) -> None:
        """run.json and the tracked run say failed; the error in hand stays the one reported."""
        try:
            self.write_status("failed", error=error[:2000])
        except OSError as e:
            log.warning("could not record the failure in %s: %s", self.rundir.status_path, e)
        try:
            if self.store.steps():
                self._summary("failed")
        except Exception as e:
            log.debug("no end summary: %s", e)
        self.job.tracker.finish("FAILED", self.rundir.path)

    def _draw(self) -> Path | None:
        """curves.png from the whole metrics.jsonl (a resumed run's earlier steps too)."""
        try:
            return curves.write(self.rundir.path, self.rundir.read_metrics())
        except (OSError, CheckpointError, ValueError) as e:
            where = self.rundir.path / curves.NAME
            log.warning("could not draw %s: %s", where, environment_error(e) or e)
            return None

    def _summary(self, status: str) -> None:
        """curves.png, then the end summary: after the last checkpoint (matplotlib's import alone is ~0.5 s)."""
        with self.profile.phase("end summary"):
            release_freed_memory()
            curve = self._draw()
            kept, store = self.store.steps(), self.store
            links = {n: store.root / n if store.link_dir(n) else None for n in ("final", "best")}
            links["newest"] = kept[-1][1] if kept else None
            tracker, source = self.job.tracker, self.job.config["resume"]["source"]
            block = report.end_block(
                status=status,
                step=self.state.step,
                run_dir=self.rundir.path,
                best=self._best(),
                links=links,
                curve=curve,
                run_uri=self.job.facts.get("mlflow_run_uri") or tracker.run_uri(timeout=0.0),
                tracking_uri=getattr(tracker, "uri", None),
                overrides=self.command,
                resume=continued_by(source, self.command, links["newest"], status == "complete"),
                samples=bool(self.state.dataset.spec.vocab_size),
                experiment_id=getattr(tracker, "experiment_id", None),  # your own may lack it
            )
            log.info("%s", block)

    def _best(self) -> tuple | None:
        """(monitor, best value, its step) of the stage that keeps checkpoints/best, if it has one."""
        for s in self.job.stages:
            if s.link == "best" and getattr(s, "best", None) is not None:
                return s.monitor, s.best, s.best_step
        return None

    def failure(self, message: str) -> str:
        """A full or read-only disk's one line, with what run.json says and where a re-run continues."""
        failed = self.rundir.read_status().get("status") == "failed"
        kept = self.store.steps()
        where = f"; {self.resume_hint()}, from its checkpoint of step {kept[-1][0]}" if kept else ""
        return message + ("; run.json says failed" if failed else "") + where

    def resume_hint(self) -> str:
        """What continues this stopped run (what the identical command does depends on resume.source)."""
        kept, source = self.store.steps(), self.job.config["resume"]["source"]
        if source != NEVER:
            return "re-run the same command to resume"
        if not kept:
            return "nothing to resume from (no checkpoint); the same command starts a new run (resume=never)"
        add = continued_by(source, [], kept[-1][1], False)[0]
        return f"the same command starts a new run (resume=never); add {add} to continue this one"

    def objective(self) -> float:
        """What a sweeper optimises: `optimized_metric` (null: the best value of the best-val stage's monitor)."""
        if (name := self.job.config["optimized_metric"]) is None:
            best = self._best()
            return float(best[1]) if best is not None else math.nan
        return float(self.state.metrics.get(name, math.nan))

    def _metrics(self) -> str:
        return " ".join(f"{k}={v:.6g}" for k, v in sorted(self.state.metrics.items()))

    def _confirm(self) -> Outcome:
        """A complete run: what a kill after its last save left undone is finished; one that says so is left as is."""
        if not self.rundir.read_only:  # on a read-only medium it is confirmed as it is
            if not self.plan.settled:
                self.retain()
                self.write_status("complete")
            if not (self.rundir.path / curves.NAME).exists():  # killed before its curve was drawn
                self._draw()
        self.job.tracker.attach(self.rundir.path)  # a sweep job: its run shows in the sweep
        print(f"run {self.rundir.path} is complete at step {self.state.step}: {self._metrics()}")
        assert self.plan.resumed is not None, "a complete run was resumed"
        recorded = written_now(self.plan.resumed.manifest["config"])
        if unapplied := "; ".join(identity.described(recorded, self.job.config)):
            said = "not applied to a finished run: %s (resume.allow_changes=[...] with more steps"
            log.warning(said + " trains it on; resume=never trains anew)", unapplied)
        return Outcome("complete", EXIT_OK, self.objective())

    def execute(self, eval_every: int) -> Outcome:
        """Train from the plan's history to the end or a preemption (a signal, trainer.max_time): the Outcome."""
        if self.plan.complete:
            return self._confirm()
        tracker = self.job.tracker
        self.profile.start()
        log.info("%s", report.start_block(self.job, self.rundir.path))
        self.write_status("running")
        resumed = self.plan.resumed
        self._handover(
            tracker.start,
            config=self.job.config,
            facts=self.job.facts,
            run_dir=self.rundir.path,
            previous_run_uri=resumed.manifest.get("mlflow_run_uri") if resumed else None,
            status=self.rundir.read_status(),
            start_time=self.plan.history["started"],
        )
        try:
            self.stopped = SIGNALS_STATE.name  # one that came while setting up: nothing new to save
            if self.stopped is None:
                self.train(eval_every)
            extra = {} if self.stopped is None else {"preempted_by": self.stopped}
            self.write_status("complete" if self.stopped is None else "preempted", **extra)
        except BaseException as e:  # a non-finite loss says so itself; anything else with its type
            said = environment_error(e) or f"{type(e).__name__}: {e}"
            self._failed(str(e) if isinstance(e, NonFiniteError) else said)
            raise
        state = self.state
        if self.stopped is None:
            took, where = budget.process_age(), "process"
            if self.started is not None:  # a sweep's job: its own time
                took, where = time.time() - self.started, "job"
            done = "done at step %d (%s) after %.1f s in this %s: %s"
            log.info(done, state.step, state.progress.ended, took, where, self._metrics())
            outcome = Outcome("complete", EXIT_OK, self.objective())
        else:
            said = f"preempted at step {state.step}; {self.resume_hint()}"
            outcome = Outcome("preempted", EXIT_PREEMPTED, message=said, requeue=True)
        self._summary(outcome.status)
        if self.stopped is not None:
            said = "preempted by %s at step %d; %s (exit %d)"
            log.warning(said, self.stopped, state.step, self.resume_hint(), EXIT_PREEMPTED)
        # the tracked run's end, then trainer.profile's table (this process's share of the run)
        self._handover(tracker.finish, "KILLED" if self.stopped else "FINISHED", self.rundir.path)
        if self.profile.on:
            print(self.profile.table(), flush=True)
        return outcome
