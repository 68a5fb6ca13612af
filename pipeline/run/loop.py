"""One job in its run directory: the stages' set-up, training with one decision per step end, checkpoint, retain,
finish (at most one checkpoint per step, tagged with the stages that asked for it)."""

from __future__ import annotations

import errno
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.retention import AnyOf, LatestN
from pipeline.config import identity
from pipeline.config.checks import parse_duration
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, EXIT_PREEMPTED, CommandError
from pipeline.files import killpoint
from pipeline.files.atomic import environment_error, named
from pipeline.model.minigpt import release_freed_memory
from pipeline.run import budget, report
from pipeline.run.assemble import Job
from pipeline.run.directory import RunDir
from pipeline.run.signals import Signals
from pipeline.stages.base import StepEnd
from pipeline.stages.resume import continued_by, resume_hint, start_fresh
from pipeline.stateful import capture
from pipeline.trainer import curves
from pipeline.trainer.display import Display
from pipeline.trainer.loop import epoch_ended, epochs_done, fit, metrics_of
from pipeline.trainer.metrics_log import MetricsLog
from pipeline.trainer.phases import Profile

log = logging.getLogger("pipeline")
# Keys that only say where a run writes, how it shows progress and how long one process may run: a resume that
# changes any other key of the recorded config keeps the checkpoints as they stood (keep_history).
WHERE_AND_HOW_LONG = (
    "paths",
    "tracking",
    "hydra",
    "resume",
    "verify",
    "trainer.progress_bar",
    "trainer.max_time",
    "trainer.profile",
)


class Preempted(Exception):
    """A signal arrived during training: the step finished and its checkpoint is written."""


class NonFiniteError(CommandError):
    """A non-finite training loss or validation metric with trainer.on_nonfinite=stop."""

    exit_code = EXIT_ERROR


class Run:
    def __init__(
        self,
        job: Job,
        rundir: RunDir,
        signals: Signals,
        started: float,
        overrides: list[str],
        in_sweep: bool,
    ):
        self.job, self.rundir, self.signals = job, rundir, signals
        self.in_sweep = (
            in_sweep  # a sweep's job: its siblings differ on purpose, and its time is its own
        )
        self.overrides = list(
            overrides
        )  # the command's, for the identical command in the end summary
        self.job_started = started  # a sweep's job: when it started, not its process
        self.state = job.state
        self.lineage: dict | None = None
        self.complete = False
        self.resumed: Checkpoint | None = None
        self.metrics_kept: list[dict] | None = (
            None  # what metrics.jsonl is cut to, written once the run claims
        )
        self.superseded: Path | None = (
            None  # where an earlier history went (resume.source), if it moved
        )
        self.aside: list[
            Path
        ] = []  # newer checkpoints the resume fell back past: to superseded/, never deleted
        self.metrics_cut = (
            False  # metrics.jsonl holds lines past the resumed step: the whole file is kept aside
        )
        self.retuned: list[
            str
        ] = []  # the config changed since the checkpoint: its store is kept as it stood
        self.history: dict = {"started": started, "resumes": []}  # run.json: first start, resumes
        max_time = job.config["trainer"].get("max_time")
        self.budget = budget.Budget(None if max_time is None else parse_duration(max_time))
        self.profile = Profile(
            job.config["trainer"].get("profile")
        )  # absent from a config older than the key

    @property
    def store(self):
        return self.rundir.store  # a new object once a history moves aside

    # --- before training: what the resume stage decides (pipeline/stages/resume.py)
    def begin(
        self,
        lineage: dict,
        resumed: Checkpoint | None = None,
        metrics: list[dict] | None = None,
        allowed: dict | None = None,
        metrics_cut: bool = False,
    ) -> None:
        """The history this run continues: `resumed` None from scratch; `metrics` None keeps metrics.jsonl as it is."""
        self.lineage, self.resumed = lineage, resumed
        self.complete = resumed is not None and self.state.progress.ended is not None
        if allowed:
            self.job.facts["allowed_changes"] = allowed
        if not self.complete:
            self.metrics_kept, self.metrics_cut = metrics, metrics_cut
        own = (
            resumed is not None and resumed.directory.parent == self.store.root
        )  # not a fork's source
        if own:
            assert resumed is not None
            self.retuned = identity.described(
                resumed.manifest["config"],
                self.job.config,
                lambda k: not identity.covered(k, list(WHERE_AND_HOW_LONG)),
            )
        previous = self.rundir.read_status() if own else {}
        if isinstance(previous.get("started"), (int, float)):
            self.history = {
                "started": previous["started"],
                "resumes": list(previous.get("resumes") or []),
            }
            if not self.complete and resumed is not None:
                self.history["resumes"].append({"step": resumed.step, "time": time.time()})

    def settled(self) -> bool:
        """A complete run whose run.json says so: a re-run confirms it and changes no file of it."""
        return self.complete and self.rundir.read_status().get("status") == "complete"

    def set_aside(self, skipped: list[tuple[Path, str, str]]) -> None:
        """The step directories a resume falls back past ((directory, what it is, why), newest first), each said in
        one line: moved to superseded/ once the run claims the directory (keep_history), never deleted."""
        for _, what, error in skipped:
            log.warning(
                "not resuming from %s (kept in superseded/, nothing is deleted), falling back: %s",
                what,
                error,
            )
        self.aside = [directory for directory, _, _ in skipped]

    def holds_history(self) -> bool:
        """Whether the run directory holds a history (checkpoints, metrics, a status) a fresh start must keep."""
        rundir = self.rundir
        return bool(
            self.store.steps() or rundir.metrics_path.exists() or rundir.status_path.exists()
        )

    def supersede(self) -> Path:
        """Move the run directory's other history aside, whole (a signal waits): set-up's one durable change."""
        with self.signals.atomic():
            self.superseded = self.rundir.supersede()
        self.aside = []  # moved with the rest
        return self.superseded

    def keep_history(self) -> None:
        """Before this run changes anything it found: the checkpoints it fell back past go to superseded/<when>/,
        and so does what it cuts back (metrics.jsonl past its resume step), or what a changed policy could prune
        (every checkpoint and link as they stood, as second names of the same files: no bytes copied). Nothing
        earlier is deleted: an earlier history's best and final stay reachable whatever the live stages say."""
        if not (self.aside or self.metrics_cut or self.retuned):
            return
        where = self.rundir.set_aside(
            self.aside, metrics=self.metrics_cut, snapshot=bool(self.retuned)
        )
        kept = [p.name for p in self.aside] + ["metrics.jsonl"] * self.metrics_cut
        if self.retuned:
            kept.append(
                f"the checkpoints as they stood (changed since the checkpoint: {', '.join(self.retuned)})"
            )
        log.warning("kept in %s (nothing is deleted): %s", where, "; ".join(kept))
        self.aside, self.metrics_cut, self.retuned = [], False, []

    def rundir_of(self, path: Path) -> RunDir:
        """Another run directory, to read (for the stages, a layer below RunDir)."""
        return RunDir(path)

    # --- training
    def train(self, eval_every: int) -> None:
        trainer = self.job.config["trainer"]
        callbacks: list[MetricsLog | Display] = [
            MetricsLog(self.rundir.open_metrics, trainer["log_every"], sinks=[self._log_line]),
            Display(trainer["progress_bar"], trainer["log_every"]),
        ]
        try:
            self.budget.start()
            fit(self.state, eval_every, self.step_end, callbacks, self.profile)
        finally:
            for cb in callbacks:
                cb.close()

    def _log_line(self, line: dict) -> None:
        with self.profile.phase("tracking hand-over"):
            self.job.tracker.log_line(line)

    def step_end(self, record: dict) -> bool:
        """The one decision after every update: stop?, checkpoint (who asked)?, preempted? True ends training."""
        metrics = metrics_of(record)
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad and self.job.config["trainer"]["on_nonfinite"] == "stop":
            raise NonFiniteError(
                f"step {record['step']}: {bad[0]} is {metrics[bad[0]]} (non-finite); stopping "
                "with the last good checkpoints kept (trainer.on_nonfinite=continue trains on)"
            )
        end = StepEnd(
            step=self.state.step,
            metrics=metrics,
            epoch_done=epoch_ended(self.state, record),
            epochs_done=epochs_done(self.state),
            last=self.state.step >= self.state.total_steps,
        )
        # every stage sees every step end (a stateful one must not miss the step another stops on)
        stop = next((r for r in [s.stop_reason(end) for s in self.job.stages] if r), None)
        if stop:
            end = replace(end, last=True)
        if end.last:
            self.state.progress.ended = stop or "max_steps"
        tags = [s.name for s in self.job.stages if s.wants_checkpoint(end)]
        # A spent trainer.max_time is a preemption announced in advance: checkpoint now, exit 75, requeue.
        preempted = self.budget.step_ended() or self.signals.received is not None
        if tags or preempted or end.last:
            self.checkpoint(metrics, tags, final=end.last or preempted)
        if end.last:
            return True
        if preempted:
            raise Preempted(
                self.signals.name or f"trainer.max_time={self.job.config['trainer']['max_time']}"
            )
        return False

    def checkpoint(self, metrics: dict, tags: list[str], final: bool = False) -> Checkpoint:
        tracker = self.job.tracker
        # Only the last save (the end, or a preemption) waits for the tracked run's URI: earlier manifests
        # carry it once the tracker knows it, so training never waits for mlflow to start.
        with self.profile.phase("tracking hand-over"):
            self.job.facts["mlflow_run_uri"] = tracker.run_uri(timeout=30.0 if final else 0.0)
        with self.profile.phase("checkpoint"):
            assert self.lineage is not None, "begin() comes before the first checkpoint"
            fields = mf.build(
                self.job.facts,
                step=self.state.step,
                epoch=self.state.epoch,
                metrics=metrics,
                tags=tags,
                lineage=self.lineage,
            )
            started = budget.monotonic()
            try:
                ckpt = self.store.save(self.state.step, capture(self.job.parts), fields)
            except OSError as e:
                raise named(
                    e, self.store.root
                ) from e  # a write inside the temporary checkpoint: name the store
            self.retain()
            self.budget.saved(budget.monotonic() - started)
        with self.profile.phase("tracking hand-over"):
            tracker.log_checkpoint(ckpt.directory, ckpt.manifest)
        return ckpt

    def retain(self) -> None:
        """The stages' policies as they stand now (a best history restarted at the resume ranks from there)."""
        stages = self.job.stages
        assert self.lineage is not None, "begin() comes before retention"
        keep = AnyOf((*tuple(p for s in stages if (p := s.policy()) is not None), LatestN(1)))
        self.store.retain(
            keep,
            {s.link: s.link_policy() for s in stages if s.link},
            upto=self.state.step,
            lineage=self.lineage["id"],
            named=tuple(n for s in stages if (n := s.named()) is not None),
        )

    # --- run.json
    def write_status(self, status: str, **extra) -> None:
        if status != "running":
            extra["ended_at"] = time.time()
        fields = dict(
            status=status,
            step=self.state.step,
            total_steps=self.state.total_steps,
            epoch=self.state.epoch,
            metrics=self.state.metrics,
            ended=self.state.progress.ended,
            config_hash=self.job.facts["config_hash"],
            data_manifest_hash=self.job.facts["data_manifest_hash"],
            **self.history,
            **extra,
        )
        try:
            self.rundir.write_status(**fields)
        except OSError as e:
            # Too full for the atomic replace's temporary: an ending still must not leave `running` behind.
            if (
                status == "running"
                or e.errno not in (errno.ENOSPC, errno.EDQUOT)
                or not self.rundir.status_path.exists()
            ):
                raise
            self.rundir.write_status_in_place(**fields)

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
            log.warning(
                "could not draw %s: %s", self.rundir.path / curves.NAME, environment_error(e) or e
            )
            return None

    def _summary(self, status: str) -> None:
        with self.profile.phase("end summary"):
            self._summarise(status)

    def _summarise(self, status: str) -> None:
        """curves.png, then the end summary: after the last checkpoint (matplotlib's import alone is ~0.5 s)."""
        release_freed_memory()
        curve = self._draw()
        kept = self.store.steps()
        links = {
            name: self.store.root / name if self.store.link_dir(name) else None
            for name in ("final", "best")
        }
        links["newest"] = kept[-1][1] if kept else None
        best = next(
            (
                (s.monitor, s.best, s.best_step)
                for s in self.job.stages
                if s.link == "best" and getattr(s, "best", None) is not None
            ),
            None,
        )
        tracker = self.job.tracker
        log.info(
            "%s",
            report.end_block(
                status=status,
                step=self.state.step,
                run_dir=self.rundir.path,
                best=best,
                links=links,
                curve=curve,
                run_uri=self.job.facts.get("mlflow_run_uri") or tracker.run_uri(timeout=0.0),
                tracking_uri=getattr(tracker, "uri", None),
                overrides=self.overrides,
                resume=continued_by(
                    self.job.config["resume"]["source"],
                    self.overrides,
                    links["newest"],
                    status == "complete",
                ),
                samples=bool(self.state.dataset.spec.vocab_size),
                experiment_id=getattr(tracker, "experiment_id", None),
            ),
        )

    def unapplied(self) -> str:
        """What of the live config differs from the config the finished run recorded."""
        assert self.resumed is not None, "only a finished run, resumed, has a config to compare"
        return "; ".join(identity.described(self.resumed.manifest["config"], self.job.config))

    def failure(self, message: str) -> str:
        """A full or read-only disk's one line, with what run.json says and where a re-run continues."""
        said = (
            "; run.json says failed" if self.rundir.read_status().get("status") == "failed" else ""
        )
        kept = self.store.steps()
        return (
            message
            + said
            + (f"; {self.resume_hint()}, from its checkpoint of step {kept[-1][0]}" if kept else "")
        )

    def resume_hint(self) -> str:
        """What continues this stopped run (what the identical command does depends on resume.source)."""
        kept = self.store.steps()
        return resume_hint(self.job.config["resume"]["source"], kept[-1][1] if kept else None)

    def objective(self) -> float:
        """What a sweeper optimises: `optimized_metric` (null: the best value of the best-val stage's monitor)."""
        if (name := self.job.config["optimized_metric"]) is None:
            best = [
                s.best
                for s in self.job.stages
                if getattr(s, "link", None) == "best" and hasattr(s, "best")
            ]
            return float(best[0]) if best and best[0] is not None else math.nan
        return float(self.state.metrics.get(name, math.nan))

    def _metrics(self) -> str:
        return " ".join(f"{k}={v:.6g}" for k, v in sorted(self.state.metrics.items()))

    def setup(self) -> None:
        """Every stage's set-up (the resume stage restores or starts). A signal still stops the process at once
        here (a long load is interruptible), so it writes nothing durable but supersede(), whole."""
        killpoint.point("setup", "start")
        for s in self.job.stages:
            s.setup(self)
        if self.lineage is None:
            start_fresh(self)

    def execute(self) -> tuple[int, float]:
        """The run's exit code and its objective (NaN if it did not complete)."""
        if self.complete:
            # A process killed between its last save and its last word: finish what it left (links, pruning,
            # status). A run that says complete is left exactly as it is, whatever the live config says now.
            if not self.rundir.read_only:  # on a read-only medium it is confirmed as it is
                if not self.settled():
                    self.keep_history()
                    self.retain()
                    self.write_status("complete")
                if not (
                    self.rundir.path / curves.NAME
                ).exists():  # killed before its curve was drawn
                    self._draw()
            self.job.tracker.attach(self.rundir.path)  # a sweep job: its run shows in the sweep
            print(
                f"run {self.rundir.path} is complete at step {self.state.step}: {self._metrics()}"
            )
            if unapplied := self.unapplied():
                log.warning(
                    "not applied to a finished run: %s (resume.allow_changes=[...] with more steps trains "
                    "it on; resume=never trains anew)",
                    unapplied,
                )
            return EXIT_OK, self.objective()
        tracker = self.job.tracker
        self.profile.start()
        self.keep_history()
        if self.metrics_kept is not None:
            self.rundir.keep_metrics(self.metrics_kept)
        log.info("%s", report.start_block(self.job, self.rundir.path))
        self.write_status("running")
        with self.profile.phase("tracking hand-over"):
            tracker.start(
                config=self.job.config,
                facts=self.job.facts,
                run_dir=self.rundir.path,
                previous_run_uri=(
                    self.resumed.manifest.get("mlflow_run_uri") if self.resumed else None
                ),
                status=self.rundir.read_status(),
                start_time=self.history["started"],
            )
        try:
            if self.signals.received is not None:
                raise Preempted(self.signals.name)  # arrived while setting up: nothing new to save
            for s in self.job.stages:
                if hasattr(s, "run"):
                    s.run(self)
            self.write_status("complete")
            stopped_by = None
        except Preempted as stop:
            stopped_by = str(stop)
            self.write_status("preempted", preempted_by=stopped_by)
        except BaseException as e:  # a non-finite loss says so itself; anything else with its type
            self._failed(
                str(e)
                if isinstance(e, NonFiniteError)
                else environment_error(e) or f"{type(e).__name__}: {e}"
            )
            raise
        if stopped_by is None:
            log.info(
                "done at step %d (%s) after %.1f s in this %s: %s",
                self.state.step,
                self.state.progress.ended,
                time.time() - self.job_started if self.in_sweep else budget.process_age(),
                "job" if self.in_sweep else "process",
                self._metrics(),
            )
        code, value = (
            (EXIT_OK, self.objective()) if stopped_by is None else (EXIT_PREEMPTED, math.nan)
        )
        self._summary("complete" if stopped_by is None else "preempted")
        if stopped_by is not None:
            log.warning(
                "preempted by %s at step %d; %s (exit %d)",
                stopped_by,
                self.state.step,
                self.resume_hint(),
                EXIT_PREEMPTED,
            )
        # the tracked run's end, then trainer.profile's table (this process's share of the run)
        with self.profile.phase("tracking hand-over"):
            self.job.tracker.finish(
                "FINISHED" if stopped_by is None else "KILLED", self.rundir.path
            )
        if self.profile.on:
            print(self.profile.table(), flush=True)
        return code, value
