"""Which history a run continues: `plan` decides (writing nothing), `apply` makes its one durable change."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint, CheckpointDir, file_hashes, files_of
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.store import CheckpointStore
from pipeline.config import identity
from pipeline.config.errors import CommandError, ConfigError
from pipeline.config.targets import hydra_quoted
from pipeline.files import killpoint
from pipeline.files.atomic import ensure_dirs, fsync_dir, move, refuse_link, second_name
from pipeline.run.directory import RunDir
from pipeline.stateful import StateMismatch, capture, restore

log = logging.getLogger("pipeline")
AUTO, NEVER = "auto", "never"
MAX_HINTED = 8  # changes a sibling may differ in and still be mentioned (more: another experiment)
# Keys that only say where a run writes, how it shows progress and how long one process may run: a resume that
# changes any other key of the recorded config keeps the checkpoints as they stood (Plan.retuned).
WHERE_AND_HOW_LONG = (
    *("paths", "tracking", "hydra", "resume", "verify"),
    *("trainer.progress_bar", "trainer.max_time", "trainer.profile"),
)


@dataclass(frozen=True)
class Resume:
    """stages.resume: how a run finds its history. Settings, not a stage (`order` stays for older configs)."""

    source: str  # auto, never, or a checkpoint to fork from
    allow_changes: list[str]
    order: int


@dataclass(frozen=True)
class Train:
    """stages.train: evaluate every `eval_every` updates (0: every epoch's end). Settings, not a stage."""

    eval_every: int
    order: int


SETTINGS = {"resume": Resume, "train": Train}
# What these nodes' `_target_` named while they were stages (every config recorded until then says it).
FORMER = {
    f"pipeline.stages.{k}.{c.__name__}": f"{__name__}.{c.__name__}" for k, c in SETTINGS.items()
}


def settings(config: dict) -> tuple[Resume, Train]:
    """The resume's and training's settings; ConfigError if a config removed either (they are not stages)."""
    stages = config.get("stages") or {}
    for key, what, instead in (
        ("resume", "finding the run's history", "stages.resume.source=never starts anew each time"),
        ("train", "training", "trainer.max_steps says how long it trains"),
    ):
        if not isinstance(stages.get(key), dict):
            said = f"{what} is not a stage and cannot be removed; stages.{key} holds its settings"
            raise ConfigError(f"stages.{key} is missing (~stages.{key}?): {said} ({instead})")
    r, t = stages["resume"], stages["train"]
    allow = [str(k) for k in r.get("allow_changes") or []]
    resume = Resume(str(r["source"]), allow, int(r["order"]))
    return resume, Train(int(t["eval_every"]), int(t["order"]))


def written_now(config: dict) -> dict:
    """A recorded config with the settings nodes' former `_target_` names as they are now."""
    stages = config.get("stages")
    if not isinstance(stages, dict):
        return config
    renamed = dict(stages)
    for k, v in stages.items():
        if isinstance(v, dict) and isinstance(t := v.get("_target_"), str) and t in FORMER:
            renamed[k] = {**v, "_target_": FORMER[t]}
    return {**config, "stages": renamed}


class DriftError(CommandError):
    """The checkpoint was made by a different config or data than the current run's, and that is not allowed."""


def drift(manifest: dict, job) -> dict[str, tuple]:
    """Every semantic key (and the data) that differs between a checkpoint's run and this job (the run's Job)."""
    old = identity.semantic_config(manifest["config"], manifest["sources"])
    changes = identity.changed_keys(old, identity.semantic_config(job.config, job.sources))
    old_data, new_data = manifest["data_manifest_hash"], job.facts["data_manifest_hash"]
    if old_data != new_data:
        changes["data_manifest_hash"] = (old_data, new_data)
    return changes


def allowed(key: str, allow: list[str]) -> bool:
    if key == "data_manifest_hash":  # follows from a change of the data's config
        return any(a == "data" or a.startswith("data.") or a == key for a in allow)
    return identity.covered(key, allow)


def refuse(changes: dict[str, tuple], allow: list[str], where) -> None:
    """DriftError naming each change `allow` does not cover, or an allowed one that cannot take effect."""
    refusing = f"refusing to resume from {where}:"
    if refused := {k: v for k, v in changes.items() if not allowed(k, allow)}:
        listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        then = f"allow with resume.allow_changes=[{','.join(refused)}] or start over with"
        raise DriftError(f"{refusing} the config or data changed ({listing}); {then} resume=never")
    for key in changes:
        if why := identity.not_applicable(key):
            said = f"resume.allow_changes lets {key} through, but it cannot take effect on a resumed run"
            raise DriftError(f"{refusing} {said} ({why}); start over with resume=never")


def origin_of(source: str, manifest: dict | None = None) -> dict | None:
    """A fork's origin (resume.source=PATH, its `manifest` if read) as its lineage records it (None: auto, never)."""
    if source in (AUTO, NEVER):
        return None
    path = CheckpointDir(Path(source).expanduser()).resolved().resolve()
    manifest = manifest or CheckpointDir(path).manifest()
    weights = file_hashes(manifest)["weights"]
    return {"checkpoint": str(path), "step": manifest["step"], "weights_sha256": weights}


def continued_by(source: str, overrides: list, newest: Path | None, complete: bool) -> list[str]:
    """The arguments of the command that continues a run ([]: none does): the identical command, but with
    resume=never that starts a new run, so a stopped one is continued from its `newest` checkpoint, as a fork."""
    if source != NEVER:
        return list(overrides)
    if newest is None or complete:
        return []
    kept = [o for o in overrides if not o.lstrip("+").startswith("resume.source=")]
    return [*kept, f"resume.source={hydra_quoted(str(newest))}"]


@dataclass(frozen=True)
class Plan:
    """The history a run continues and what set-up moves to superseded/ to continue it (never deleted)."""

    lineage: dict
    resumed: Checkpoint | None = None  # None: a history from scratch
    complete: bool = False  # the resumed run ended: confirmed as it is, nothing trained
    settled: bool = False  # complete, and its run.json says so: a re-run changes no file of it
    metrics: tuple[dict, ...] | None = None  # what metrics.jsonl is cut to (None: left as it is)
    fallback: tuple[tuple[Path, str, str], ...] = ()  # (dir, what, why) passed over, newest first
    cut: bool = False  # metrics.jsonl holds lines past the resumed step: kept whole aside
    retuned: tuple[str, ...] = ()  # changed since the checkpoint: its checkpoints kept as they were
    supersede: str | None = None  # "fresh", or a fork's source: the whole history moves aside
    allowed: dict = field(default_factory=dict)  # {key: [old, new]} let through by allow_changes
    other_code: str = ""  # how the code that trained the checkpoint differs from this
    notes: tuple[str, ...] = ()  # the stages whose state was not restored, and why
    foreign: Checkpoint | None = None  # a fork's newest checkpoint in a clean run's directory
    sibling: str = ""  # a fresh start's hint: how the newest run of its experiment differs
    history: dict = field(default_factory=dict)  # run.json's first start and resumes


def holds_history(rundir: RunDir) -> bool:
    """Whether a run directory holds a history (checkpoints, metrics, a status) a new one must keep aside."""
    paths = (rundir.metrics_path, rundir.status_path)
    return bool(rundir.store.steps() or any(p.exists() for p in paths))


def plan(rundir: RunDir, job, resume: Resume, started: float, in_sweep: bool) -> Plan:
    """The history this run continues, `job`'s parts restored to it; reads only (DriftError, CheckpointError)."""
    killpoint.point("setup", "start")
    if resume.source == NEVER:
        return _fresh(rundir, job, started, in_sweep)
    if resume.source != AUTO:
        return _fork(rundir, job, resume, Path(resume.source).expanduser(), started)
    ckpt, skipped = rundir.store.newest_valid(job.parts)
    if ckpt is None or ckpt.manifest["lineage"].get("origin") is not None:  # a fork's: foreign
        return _fresh(rundir, job, started, in_sweep, tuple(skipped), ckpt)
    return _continued(rundir, job, resume, ckpt, ckpt.manifest["lineage"], started, skipped)


def _fresh(rundir: RunDir, job, started: float, in_sweep: bool, fallback=(), foreign=None) -> Plan:
    """A history from scratch: what an earlier one left (none of which this run can continue) moves aside."""
    moves = holds_history(rundir) and not rundir.read_only  # read-only: refused, nothing written
    return Plan(
        identity.lineage_of(job.facts["semantic_config_hash"], None),
        fallback=fallback,
        supersede="fresh" if moves else None,
        foreign=foreign,
        sibling="" if in_sweep else _sibling(rundir, job),  # in a sweep, siblings differ on purpose
        history={"started": started, "resumes": []},
    )


def _continued(rundir, job, resume, ckpt, lineage, started, skipped) -> Plan:
    """This directory's own history from `ckpt` on (its metrics cut back to the checkpoint's step)."""
    lines = rundir.read_metrics()  # read first: a damaged metrics.jsonl is named before any drift
    restored = _restore(job, ckpt, resume.allow_changes)
    complete = job.state.progress.ended is not None
    kept = tuple(ln for ln in lines if ln["step"] <= ckpt.step)
    recorded = written_now(ckpt.manifest["config"])
    fixed = list(WHERE_AND_HOW_LONG)
    retuned = identity.described(recorded, job.config, lambda k: not identity.covered(k, fixed))
    previous = rundir.read_status()
    history = {"started": started, "resumes": []}
    if isinstance(previous.get("started"), (int, float)):
        resumes = list(previous.get("resumes") or [])
        resumes += [] if complete else [{"step": ckpt.step, "time": time.time()}]
        history = {"started": previous["started"], "resumes": resumes}
    return Plan(
        lineage,
        ckpt,
        complete=complete,
        settled=complete and previous.get("status") == "complete",
        metrics=None if complete else kept,
        fallback=tuple(skipped),
        cut=not complete and len(kept) < len(lines),
        retuned=tuple(retuned),
        history=history,
        **restored,
    )


def _fork(rundir, job, resume, source: Path, started: float) -> Plan:
    """Another run's checkpoint as this run's start (again: this fork's own newest checkpoint)."""
    source = CheckpointDir(source).resolved().resolve()  # a link out of a run: refused
    src = CheckpointDir(source).load()  # its fit is checked once the drift is known
    lineage = job.lineage  # its origin was read as the run was named (origin_of): the same one
    if origin_of(str(source), src.manifest) != lineage["origin"]:
        why = "it changed while the run started, or stages.resume.source is not resume.source"
        raise CheckpointError(source, "", f"not the checkpoint this run was named after ({why})")
    own, skipped = rundir.store.newest_valid(job.parts)
    if own is not None and own.manifest["lineage"]["id"] == lineage["id"]:
        return _continued(rundir, job, resume, own, lineage, started, skipped)  # this fork, again
    restored = _restore(job, src, resume.allow_changes, fork=True)
    owner = RunDir.of_checkpoint(source)  # the source's run directory, if it is a step of one
    lines = owner.read_metrics() if owner is not None else []
    return Plan(
        lineage,
        src,
        metrics=tuple(ln for ln in lines if ln["step"] <= src.step),
        supersede=str(source) if holds_history(rundir) else None,
        history={"started": started, "resumes": []},
        **restored,
    )


def _restore(job, ckpt: Checkpoint, allow: list[str], fork: bool = False) -> dict:
    """Refuse drift not allowed, or nothing left to train; else restore `job`: the Plan's allowed, notes, other_code."""
    changes = drift(ckpt.manifest, job)
    refuse(changes, allow, ckpt.directory)
    try:
        restore(job.parts, ckpt.state)
    except StateMismatch as e:
        why = f" (with the allowed changes {', '.join(changes)})" if changes else ""
        files = files_of(e, ckpt.state, capture(job.parts))
        said = f"{e.part} does not fit the live run{why}: {e.reason}"
        raise CheckpointError(ckpt.directory, files, said) from None
    states = job.parts["stages"]
    for s in job.stages:
        if s.name in states.fresh:
            s.start_at(ckpt.step)
    state = job.state
    if changes:
        state.progress.ended = None  # e.g. more steps for a finished run
    refusing = f"refusing to resume from {ckpt.directory}:"
    if fork and state.progress.ended is not None:
        ended = f"{refusing} its run ended there (at step {ckpt.step}, {state.progress.ended})"
        said = "so a fork of it trains nothing; use that checkpoint as it is, or train it on with a"
        then = "larger trainer.max_steps and resume.allow_changes=[trainer.max_steps]"
        raise DriftError(f"{ended}, {said} {then}")
    if state.progress.ended is None and state.step >= state.total_steps:
        said = f"it is at step {ckpt.step}, and this config ends at step {state.total_steps}"
        then = "nothing is left to train; resume from an earlier checkpoint or train longer"
        raise DriftError(f"{refusing} {said} (trainer.max_steps or trainer.epochs): {then}")
    allowed = {k: [old, new] for k, (old, new) in changes.items()}
    other_code = mf.code_change(ckpt.manifest, job.facts) or ""
    return {"allowed": allowed, "notes": tuple(states.notes), "other_code": other_code}


def _sibling(rundir: RunDir, job) -> str:
    """When the newest run of the same experiment differs from this one: how, and how to continue it."""
    here, siblings = rundir.path, []
    for p in here.parent.glob(f"{job.config.get('name', 'run')}-*"):
        if p == here or not p.is_dir() or p.is_symlink():
            continue
        try:
            status = RunDir(p).read_status()
        except CheckpointError:
            continue  # another run's damaged run.json: that run's business, not this one's
        ended = status.get("status") in ("complete", "preempted", "failed", "running")
        if isinstance(status.get("updated"), (int, float)) and ended:
            siblings.append((status["updated"], p, status))
    if not siblings:
        return ""
    _, other, status = max(siblings)
    store = RunDir(other).store
    try:
        found = store.newest_manifest()
    except OSError:  # a stray file or link in its checkpoints/: nothing to point at
        return ""
    if found is None or not (changes := drift(found[1], job)) or len(changes) > MAX_HINTED:
        return ""
    newest, manifest = found
    # data.x covers the data
    keys = ",".join(k for k in changes if not allowed(k, [c for c in changes if c != k]))
    what = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    finished = status["status"] == "complete"
    source = store.root / ("final" if finished else newest.name)
    how = f"; to continue that one instead use resume.source={source} resume.allow_changes=[{keys}]"
    said = "finished" if finished else "interrupted"
    end = how if manifest["step"] < job.state.total_steps else ""  # else refused
    differs = f"this config differs from the {said} run {other.name} in {what}"
    return f"{differs}: starting a new run{end}"


def apply(plan: Plan, rundir: RunDir, state, signals) -> None:
    """Set-up's one durable change, whole (moves to superseded/, metrics.jsonl cut), then said in the log."""
    dest, whole = None, plan.supersede is not None
    with signals.deferring(held=False):
        moves = plan.fallback or plan.cut or plan.retuned
        if whole or (moves and not (plan.settled or rundir.read_only)):
            dest = _aside(rundir, plan)
        if plan.metrics is not None:
            rundir.keep_metrics(list(plan.metrics))
    for _, what, why in plan.fallback:
        aside = "(kept in superseded/, nothing is deleted)"
        log.warning("not resuming from %s %s, falling back: %s", what, aside, why)
    if (foreign := plan.foreign) is not None:
        origin = foreign.manifest["lineage"]["origin"].get("checkpoint")
        said = "%s is a fork's (of %s), written where a clean run's directory is before forks were"
        log.warning(said + " named apart: not this run's history", foreign.directory, origin)
    step = plan.resumed.step if plan.resumed is not None else 0
    for note in plan.notes:
        log.info("resuming at step %d: stages.%s", step, note)
    if plan.allowed:
        changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in plan.allowed.items())
        log.warning("resuming with allowed changes, in effect from step %d: %s", step, changed)
    if dest is not None and whole:
        held, then = "another run history", f" to continue from {plan.supersede}"
        if plan.supersede == "fresh":
            held, then = "an earlier run history that this start does not continue", ""
        said = "this run directory held %s; moved it to %s (nothing deleted)%s"
        log.warning(said, held, dest, then)
    if plan.resumed is None:
        log.info("starting a new run in %s", rundir.path)
        if plan.sibling:
            log.info("%s", plan.sibling)
        return
    resumed, complete = plan.resumed, plan.complete
    if plan.other_code:
        what, then = "checkpoint", "resuming with this code (resume=never trains anew)"
        if complete:
            what, then = "run", "it is left as it is (resume=never trains it anew with this code)"
        said = "%s %s was trained by other code than this: %s; %s"
        log.warning(said, what, resumed.directory, plan.other_code, then)
    if not complete:
        said = "resuming from step %d of %d (epoch %d): %s"
        log.info(said, resumed.step, state.total_steps, state.epoch, resumed.directory)
    if dest is not None and not whole:
        kept = [p.name for p, _, _ in plan.fallback] + ["metrics.jsonl"] * plan.cut
        if plan.retuned:
            changed = ", ".join(plan.retuned)
            kept.append(f"the checkpoints as they stood (changed since the checkpoint: {changed})")
        log.warning("kept in %s (nothing is deleted): %s", dest, "; ".join(kept))


def _aside(rundir: RunDir, plan: Plan) -> Path:
    """A new superseded/<when>/: a history moved whole, else what fell back, was retuned or cut (docs/stages.md)."""
    dest = ensure_dirs(rundir.path, "superseded") / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while os.path.lexists(dest):
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    os.mkdir(dest)
    store = rundir.store.root
    if plan.supersede is not None:
        for p in (store, rundir.metrics_path, rundir.status_path):
            if os.path.lexists(p):
                move(p, dest / p.name, copy=_names_again if p == store else None)
        fsync_dir(rundir.path)
    else:
        if plan.fallback or plan.retuned:
            kept = dest / store.name
            os.mkdir(kept)
            for d, _, _ in plan.fallback:
                move(d, kept / d.name, copy=lambda step, to: CheckpointDir(step).second_names(to))
            if plan.retuned:
                _names_again(store, kept)
            fsync_dir(kept)
            fsync_dir(store)
        if plan.cut and os.path.lexists(rundir.metrics_path):
            refuse_link(rundir.metrics_path)
            second_name(rundir.metrics_path, dest / rundir.metrics_path.name)
        fsync_dir(dest)
    rundir.store = CheckpointStore(store)  # a new store: the moved one's cached listing is gone
    return dest


def _names_again(store: Path, dest: Path) -> None:
    """In `dest` (made if missing), second names of every step directory of `store`, and its links."""
    if not os.path.isdir(dest):
        os.mkdir(dest)
    steps, links = CheckpointStore(store).scan()
    for _, d in steps:
        CheckpointDir(d).second_names(dest / d.name)
    for name, target in links.items():
        os.symlink(target, dest / name)
    fsync_dir(dest)
