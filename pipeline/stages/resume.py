"""The resume stage: continue from the newest checkpoint that verifies, or from a given one, refusing drift."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint, CheckpointDir, file_hashes, files_of
from pipeline.checkpoint.errors import CheckpointError
from pipeline.config.identity import lineage_of
from pipeline.config.targets import hydra_quoted
from pipeline.stages.base import Stage
from pipeline.stages.drift import DriftError, drift, refuse, say_if_a_sibling_differs
from pipeline.stateful import StateMismatch, capture, restore

log = logging.getLogger("pipeline")
AUTO, NEVER = "auto", "never"


def origin_of(source: str) -> dict | None:
    """The checkpoint a fork (resume.source=PATH) continues, as its lineage and run name record it; None for auto and
    never. CheckpointError if it does not read (a link out of a run is refused, not followed)."""
    if source in (AUTO, NEVER):
        return None
    path = CheckpointDir(Path(source).expanduser()).resolved().resolve()
    return _origin(path, CheckpointDir(path).manifest())


def _origin(path: Path, manifest: dict) -> dict:
    return {
        "checkpoint": str(path),
        "step": manifest["step"],
        "weights_sha256": file_hashes(manifest)["weights"],
    }


def continued_by(
    source: str, overrides: list[str], newest: Path | None, complete: bool
) -> list[str]:
    """The arguments of the command that continues a run ([]: none does): the identical command, but with
    resume=never that starts a new run, so a stopped one is continued from its `newest` checkpoint, as a fork."""
    if source != NEVER:
        return list(overrides)
    if newest is None or complete:
        return []
    kept = [o for o in overrides if not o.lstrip("+").startswith("resume.source=")]
    return [*kept, f"resume.source={hydra_quoted(str(newest))}"]


def resume_hint(source: str, newest: Path | None) -> str:
    """What to do to continue a stopped run, from what the identical command will do (continued_by)."""
    if source != NEVER:
        return "re-run the same command to resume"
    if newest is None:
        return "nothing to resume from (no checkpoint); the same command starts a new run (resume=never)"
    return (
        f"the same command starts a new run (resume=never); add {continued_by(source, [], newest, False)[0]} "
        "to continue this one"
    )


class Resume(Stage):
    """Decides the history the run continues and tells the run once, through `run.begin(...)`; changes nothing
    on disk but `run.supersede()` (a fork into a directory that holds another history)."""

    name = "resume"

    def __init__(self, source: str, allow_changes: list[str], order: int):
        super().__init__(order)
        self.source, self.allow_changes = str(source), [str(k) for k in (allow_changes or [])]

    def setup(self, run) -> None:
        if self.source == NEVER:
            return start_fresh(run)
        if self.source != AUTO:
            return self._fork(run, Path(self.source).expanduser())
        ckpt, skipped = run.store.newest_valid(run.job.parts)
        run.set_aside(skipped)
        if ckpt is not None and ckpt.manifest["lineage"].get("origin") is not None:
            log.warning(
                "%s is a fork's (of %s), written where a clean run's directory is before forks were named "
                "apart: not this run's history",
                ckpt.directory,
                ckpt.manifest["lineage"]["origin"].get("checkpoint"),
            )
            ckpt = None
        if ckpt is None:
            return start_fresh(run)
        self._continue(run, ckpt, ckpt.manifest["lineage"])

    def _continue(self, run, ckpt: Checkpoint, lineage: dict) -> None:
        """This directory's own history from `ckpt` on (its metrics cut back to the checkpoint's step)."""
        _begin(
            run,
            ckpt,
            lineage,
            run.rundir.read_metrics(),
            _restore(run.job, ckpt, self.allow_changes),
        )

    def _fork(self, run, source: Path) -> None:
        source = (
            CheckpointDir(source).resolved().resolve()
        )  # a link out of a run is refused, not followed
        src = CheckpointDir(
            source
        ).load()  # its fit is checked once the drift is known (an allowed change may be why)
        lineage = (
            run.job.lineage
        )  # its origin was read as the run was named (origin_of): the same checkpoint
        if _origin(source, src.manifest) != lineage["origin"]:
            raise CheckpointError(
                source,
                "",
                "not the checkpoint this run was named after (it changed while the run "
                "started, or stages.resume.source is not resume.source)",
            )
        own, skipped = run.store.newest_valid(run.job.parts)
        if own is not None and own.manifest["lineage"]["id"] == lineage["id"]:
            run.set_aside(skipped)
            return self._continue(run, own, lineage)  # this fork, again
        allowed = _restore(
            run.job, src, self.allow_changes, fork=True
        )  # refusals first: nothing on disk changed yet
        owner = run.rundir_of(
            source.parent.parent
        )  # the source's run directory, if it is a step of one
        history = owner.read_metrics() if owner.store.root == source.parent else []
        if run.holds_history():
            where = run.supersede()
            log.warning(
                "this run directory held another run history; moved it to %s (nothing deleted) to "
                "continue from %s",
                where,
                source,
            )
        _begin(run, src, lineage, history, allowed, own=False)


def start_fresh(run) -> None:
    """A history from scratch; what an earlier one left in the run directory (checkpoints none of which this
    run can continue, metrics.jsonl, run.json) is moved whole to superseded/ first, never deleted."""
    if (
        run.holds_history() and not run.rundir.read_only
    ):  # read-only: the job ends next, nothing written
        where = run.supersede()
        log.warning(
            "this run directory held an earlier run history that this start does not continue; moved it "
            "to %s (nothing deleted)",
            where,
        )
    run.begin(lineage_of(run.job.semantic_hash, None))
    log.info("starting a new run in %s", run.rundir.path)
    if not run.in_sweep:  # in a sweep, the siblings differ on purpose
        say_if_a_sibling_differs(run)


def _begin(
    run, ckpt: Checkpoint, lineage: dict, history: list[dict], allowed: dict, own: bool = True
) -> None:
    """`history`: the metrics the checkpoint's run logged (own: this directory's, cut back to the resumed step)."""
    kept = [ln for ln in history if ln["step"] <= ckpt.step]
    run.begin(lineage, ckpt, kept, allowed, metrics_cut=own and len(kept) < len(history))
    if differs := mf.code_change(ckpt.manifest, run.job.facts):
        log.warning(
            "%s %s was trained by other code than this: %s; %s",
            "run" if run.complete else "checkpoint",
            ckpt.directory,
            differs,
            "it is left as it is (resume=never trains it anew with this code)"
            if run.complete
            else "resuming with this code (resume=never trains anew)",
        )
    if not run.complete:
        log.info(
            "resuming from step %d of %d (epoch %d): %s",
            ckpt.step,
            run.state.total_steps,
            run.state.epoch,
            ckpt.directory,
        )


def _restore(job, ckpt: Checkpoint, allow: list[str], fork: bool = False) -> dict:
    """Refuse drift not allowed or not applicable, else restore every part of `job`: the changes, {key: [old, new]};
    refused too if the restored run has nothing left to train and is not this directory's complete run (a fork of a
    run that ended, a step past this config's total): it would end without a checkpoint of its own."""
    changes = drift(ckpt.manifest, job)
    refuse(changes, allow, ckpt.directory)
    try:
        restore(job.parts, ckpt.state)
        for s in job.stages:
            if s.name in job.parts["stages"].fresh:
                s.start_at(ckpt.step)
        for note in job.parts["stages"].notes:
            log.info("resuming at step %d: stages.%s", ckpt.step, note)
    except StateMismatch as e:
        why = f" (with the allowed changes {', '.join(changes)})" if changes else ""
        raise CheckpointError(
            ckpt.directory,
            files_of(e, ckpt.state, capture(job.parts)),
            f"{e.part} does not fit the live run{why}: {e.reason}",
        ) from None
    state = job.state
    if changes:
        state.progress.ended = None  # e.g. more steps for a finished run
    if fork and state.progress.ended is not None:
        raise DriftError(
            f"refusing to resume from {ckpt.directory}: its run ended there (at step {ckpt.step}, "
            f"{state.progress.ended}), so a fork of it trains nothing; use that checkpoint as it is, or "
            "train it on with a larger trainer.max_steps and resume.allow_changes=[trainer.max_steps]"
        )
    if state.progress.ended is None and state.step >= state.total_steps:
        raise DriftError(
            f"refusing to resume from {ckpt.directory}: it is at step {ckpt.step}, and this config "
            f"ends at step {state.total_steps} (trainer.max_steps or trainer.epochs): nothing is left to "
            "train; resume from an earlier checkpoint or train longer"
        )
    if changes:
        log.warning(
            "resuming with allowed changes, in effect from step %d: %s",
            ckpt.step,
            ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()),
        )
    return {k: [old, new] for k, (old, new) in changes.items()}
