"""`python -m pipeline.show PATH [hydra.searchpath=[...]] [--json]`: what a checkpoint or a run directory
holds, and whether it verifies (docs/running.md: What each tool promises). Reading never writes."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.checkpoint.directory import CheckpointDir, file_hashes
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.manifest import code_change
from pipeline.cli import emit, metrics_line, parser, temporaries
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, CommandError
from pipeline.run.directory import RunDir
from pipeline.run.signals import command, run_command

NAME = "pipeline.show"
SUMMARY = "schema_version step epoch metrics tags config_hash data_manifest_hash git_sha git_dirty"
SUMMARY += " code_sha256 seed mlflow_run_uri lineage"


def describe_checkpoint(directory: Path, overrides: tuple[str, ...] = ()) -> dict:
    """The manifest's summary and the verdict of a full verification (an unknown `_target_` raises, no verdict)."""
    from pipeline.run.trained import UnknownTargetError, restore_checkpoint

    out: dict = {"kind": "checkpoint", "path": str(directory)}
    if directory.is_symlink():
        out["link_target"] = os.readlink(directory)
    manifest = CheckpointDir(directory).manifest_as_written()
    out.update({k: manifest[k] for k in SUMMARY.split() if k in manifest})
    if manifest:  # other_code None: this code trained it (or it cannot be told)
        out["other_code"] = code_change(manifest)
    if isinstance(files := manifest.get("files"), dict):
        out["files"] = files
    if "weights" in (hashes := file_hashes(manifest)):
        out["checkpoint_hash"] = hashes["weights"]
    try:
        restore_checkpoint(directory, list(overrides))  # restored into fresh objects, then dropped
        out["valid"], out["reason"] = True, None
    except UnknownTargetError:
        raise
    except CheckpointError as e:
        out["valid"], out["reason"] = False, str(e)
    return out


def describe_run(run_dir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """run.json's status and every checkpoint of the run with step, metrics and validity."""
    rundir = RunDir(run_dir)
    try:
        status, damaged = rundir.read_status() or None, None
    except CheckpointError as e:  # run.json damaged: shown as the run's reason
        status, damaged = None, str(e)
    out: dict = {"kind": "run", "path": str(run_dir), "run": status}
    try:
        steps, links = rundir.store.scan()
    except OSError as e:
        return out | dict(checkpoints=[], links={}, temporaries=[], valid=False, reason=str(e))
    root = rundir.store.root
    out["links"] = {name: {"target": t, "exists": (root / t).is_dir()} for name, t in links.items()}
    out["checkpoints"] = checkpoints = [
        {**describe_checkpoint(directory, overrides), "listed_step": step}
        | {"links": sorted(name for name, t in links.items() if t == directory.name)}
        for step, directory in steps
    ]
    out["temporaries"] = temporaries(root)
    out["valid"] = all(c["valid"] for c in checkpoints)
    out["valid"] &= all(link["exists"] for link in out["links"].values())
    if damaged:
        out["valid"], out["reason"] = False, damaged
    return out


def other_code(d: dict) -> list[str]:
    return [f"  trained by other code than this: {d['other_code']}"] if d.get("other_code") else []


def render_checkpoint(d: dict) -> str:
    lines = [f"checkpoint {d['path']}" + (f" -> {d['link_target']}" if "link_target" in d else "")]
    if "step" in d:
        dirty = {True: " (dirty)", False: "", None: ""}.get(d.get("git_dirty"), "")
        lines += [
            f"  step {d['step']}  epoch {d.get('epoch')}  schema_version {d.get('schema_version')}"
            f"  tags {','.join(d.get('tags') or []) or '-'}",
            f"  metrics: {metrics_line(d.get('metrics'))}",
            *(f"  {k}: {d.get(k)}" for k in ("config_hash", "data_manifest_hash")),
            f"  git_sha: {d.get('git_sha')}{dirty}  code_sha256: {d.get('code_sha256')}  seed: {d.get('seed')}",
            *other_code(d),
        ]
    for name, e in sorted((d.get("files") or {}).items()):
        if isinstance(e, dict):
            lines.append(f"  {name:<22} {e.get('size', '?'):>12} B  sha256 {e.get('sha256')}")
    valid = "valid: manifest, sizes, sha256 and contents verify"
    return "\n".join([*lines, valid if d["valid"] else f"INVALID: {d['reason']}"])


def render_run(d: dict) -> str:
    run = d.get("run") or {}
    lines = [
        f"run {d['path']}",
        f"  status: {run.get('status', 'unknown')}  step {run.get('step', '?')}/"
        f"{run.get('total_steps', '?')}  metrics: {metrics_line(run.get('metrics'))}",
    ]
    if run.get("mlflow_run_uri"):  # recorded once the run was indexed (its manifests may say null)
        lines.append(f"  mlflow_run_uri: {run['mlflow_run_uri']}")
    if "reason" in d or not d["checkpoints"]:
        lines.append(f"  INVALID: {d['reason']}" if "reason" in d else "  no checkpoints")
    for c in d["checkpoints"]:
        links = f" [{', '.join(c['links'])}]" if c["links"] else ""
        verdict = "valid" if c["valid"] else f"INVALID: {c['reason']}"
        step = f"  step {c.get('step', c['listed_step']):>8}  epoch {c.get('epoch', '?')}{links}"
        lines.append(f"{step}  {metrics_line(c.get('metrics'))}  {verdict}")
    lines += other_code(d["checkpoints"][-1]) if d["checkpoints"] else []
    for name, link in d["links"].items():
        missing = "" if link["exists"] else "  (MISSING: dangling link)"
        lines.append(f"  {name} -> {link['target']}{missing}")
    if d["temporaries"]:
        why = "an interrupted save; the next save removes them"
        lines.append(f"  ignored temporaries ({why}): {', '.join(d['temporaries'])}")
    return "\n".join(lines)


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    ap = parser(NAME, __doc__)
    ap.add_argument("path", type=Path, help="a checkpoint directory or a run directory")
    ap.add_argument("overrides", nargs="*", help="hydra.searchpath=[...]: where your configs are")
    ap.add_argument("--json", action="store_true", help="print the description as JSON")
    args = ap.parse_args(argv)
    from pipeline.config.targets import allowed

    path, overrides = args.path, tuple(args.overrides)
    if not path.is_dir():
        raise CommandError(f"{path}: not a directory")
    for bad in (o for o in overrides if not o.startswith("hydra.searchpath=")):
        raise CommandError(f"{bad}: only hydra.searchpath=[...] can be given here")
    CheckpointDir(path).resolved()  # nothing is read through a link out of a run
    if RunDir(path.parent).store.root == path and not CheckpointDir(path).exists():
        path = path.parent  # a run's checkpoints/ stands for the run
    allowed(overrides)  # a search path that is not there: said once, before any checkpoint is read
    d = (describe_run if RunDir(path).is_run() else describe_checkpoint)(path, overrides)
    emit(d, args.json, render_run if d["kind"] == "run" else render_checkpoint)
    return EXIT_OK if d["valid"] else EXIT_ERROR


if __name__ == "__main__":
    run_command(NAME, main)
