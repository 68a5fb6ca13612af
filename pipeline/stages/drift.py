"""Drift: what differs between the run a checkpoint was made by and this job; the refusal, and the hint."""

from __future__ import annotations

import logging

from pipeline.checkpoint.errors import CheckpointError
from pipeline.config import identity
from pipeline.config.errors import CommandError

log = logging.getLogger("pipeline")
MAX_HINTED = 8  # changes a sibling may differ in and still be mentioned (more: another experiment)


class DriftError(CommandError):
    """The checkpoint was made by a different config or data than the current run's, and that is not allowed."""


def drift(manifest: dict, job) -> dict[str, tuple]:
    """Every semantic key (and the data) that differs between a checkpoint's run and this job (the run's Job)."""
    old = identity.semantic_config(manifest["config"], manifest["sources"])
    changes = identity.changed_keys(old, identity.semantic_config(job.config, job.sources))
    if manifest["data_manifest_hash"] != job.facts["data_manifest_hash"]:
        changes["data_manifest_hash"] = (
            manifest["data_manifest_hash"],
            job.facts["data_manifest_hash"],
        )
    return changes


def allowed(key: str, allow: list[str]) -> bool:
    if key == "data_manifest_hash":  # follows from a change of the data's config
        return any(a == "data" or a.startswith("data.") or a == key for a in allow)
    return identity.covered(key, allow)


def refuse(changes: dict[str, tuple], allow: list[str], where) -> None:
    """DriftError naming each change `allow` does not cover, or an allowed one that cannot take effect."""
    refused = {k: v for k, v in changes.items() if not allowed(k, allow)}
    if refused:
        listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise DriftError(
            f"refusing to resume from {where}: the config or data changed ({listing}); "
            f"allow with resume.allow_changes=[{','.join(refused)}] or start over with resume=never"
        )
    for key in changes:
        if why := identity.not_applicable(key):
            raise DriftError(
                f"refusing to resume from {where}: resume.allow_changes lets {key} through, but it "
                f"cannot take effect on a resumed run ({why}); start over with resume=never"
            )


def say_if_a_sibling_differs(run) -> None:
    """When the newest run of the same experiment differs from this one, say how, and how to continue it."""
    here = run.rundir.path
    siblings = []
    for p in here.parent.glob(f"{run.job.config.get('name', 'run')}-*"):
        if p == here or not p.is_dir() or p.is_symlink():
            continue
        try:
            status = run.rundir_of(p).read_status()
        except CheckpointError:
            continue  # another run's damaged run.json: that run's business, not this one's
        if status.get("status") in ("complete", "preempted") and isinstance(
            status.get("updated"), (int, float)
        ):
            siblings.append((status["updated"], p, status))
    if not siblings:
        return
    _, other, status = max(siblings)
    store = run.rundir_of(other).store
    try:
        found = store.newest_manifest()
    except OSError:  # a stray file or link in its checkpoints/: nothing to point at
        return
    if found is None:
        return
    newest, manifest = found
    changes = drift(manifest, run.job)
    if not changes or len(changes) > MAX_HINTED:
        return
    keys = ",".join(
        k for k in changes if not allowed(k, [c for c in changes if c != k])
    )  # data.x covers the data
    what = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    finished = status["status"] == "complete"
    how = (
        "; to continue that one instead use resume.source="
        f"{store.root / ('final' if finished else newest.name)} resume.allow_changes=[{keys}]"
    )
    log.info(
        "this config differs from the %s run %s in %s: starting a new run%s",
        "finished" if finished else "interrupted",
        other.name,
        what,
        how if manifest["step"] < run.state.total_steps else "",
    )  # else refused
