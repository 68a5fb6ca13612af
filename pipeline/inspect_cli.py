"""`python -m pipeline.inspect PATH [--json]`: what a checkpoint or a run directory holds, and whether it verifies.

PATH is either a checkpoint directory (`.../checkpoints/step-00000010`, or the `best`/`final` link):
its manifest summarised, then a full verification (sizes, sha256, contents); or a run directory
(`<output_dir>/runs/<name>-<hash>/`, or its `checkpoints/`): run.json's status and every checkpoint with
its step, metrics and validity, and where `best` and `final` point.

Exit 0 if everything shown verifies, 1 if something does not (the one-line reason is printed), 2 if
PATH is not a directory. Reading never writes: temporaries are listed, not removed.

The code lives here; pipeline/inspect.py is the thin entry point (`python -m pipeline.inspect`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipeline.checkpoint import io
from pipeline.checkpoint.atomic import TMP_PREFIX
from pipeline.checkpoint.errors import CheckpointError

LINKS = ("best", "final")


def describe_checkpoint(directory: Path) -> dict:
    """The manifest's summary (whatever of it is readable) and the verdict of a full verification."""
    directory = Path(directory)
    out: dict = {"kind": "checkpoint", "path": str(directory)}
    if directory.is_symlink():
        out["link_target"] = os.readlink(directory)
    try:
        manifest = json.loads((directory / io.MANIFEST).read_bytes())
        if not isinstance(manifest, dict):
            manifest = {}
    except (OSError, ValueError):
        manifest = {}
    for key in ("schema_version", "step", "epoch", "metrics", "config_hash", "data_manifest_hash", "git_sha",
                "git_dirty", "seed", "mlflow_run_uri"):
        if key in manifest:
            out[key] = manifest[key]
    files = manifest.get("files")
    if isinstance(files, dict):
        out["files"] = files
        weights = files.get(io.WEIGHTS)
        if isinstance(weights, dict):
            out["checkpoint_hash"] = weights.get("sha256")
    try:
        io.verify(directory)
        out["valid"], out["reason"] = True, None
    except CheckpointError as e:
        out["valid"], out["reason"] = False, str(e)
    except OSError as e:  # unreadable in a way load() does not name (permissions, I/O error)
        out["valid"], out["reason"] = False, f"checkpoint {directory}: {type(e).__name__}: {e}"
    return out


def describe_run(run_dir: Path) -> dict:
    """run.json's status and every checkpoint of the run with step, metrics and validity."""
    from pipeline.stages.context import list_checkpoints

    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    out: dict = {"kind": "run", "path": str(run_dir)}
    try:
        out["run"] = json.loads((run_dir / "run.json").read_bytes())
    except (OSError, ValueError) as e:
        out["run"] = None
        out["run_error"] = f"run.json: {type(e).__name__}: {e}"
    links = {}
    for name in LINKS:
        link = root / name
        if link.is_symlink():
            target = os.readlink(link)
            links[name] = {"target": target, "exists": (root / target).is_dir()}
    out["links"] = links
    checkpoints = []
    for step, directory in list_checkpoints(root):
        d = describe_checkpoint(directory)
        d["listed_step"] = step
        d["links"] = [name for name, link in links.items() if link["target"] == directory.name]
        checkpoints.append(d)
    out["checkpoints"] = checkpoints
    out["temporaries"] = sorted(p.name for p in root.iterdir() if p.name.startswith(TMP_PREFIX)) if root.is_dir() else []
    out["valid"] = all(c["valid"] for c in checkpoints) and all(link["exists"] for link in links.values())
    return out


def _metrics(metrics) -> str:
    if not isinstance(metrics, dict) or not metrics:
        return "-"
    return " ".join(f"{k}={v:.6g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in sorted(metrics.items()))


def render_checkpoint(d: dict) -> str:
    lines = [f"checkpoint {d['path']}" + (f" -> {d['link_target']}" if "link_target" in d else "")]
    if "step" in d:
        lines.append(f"  step {d['step']}  epoch {d.get('epoch')}  schema_version {d.get('schema_version')}")
        lines.append(f"  metrics: {_metrics(d.get('metrics'))}")
        lines.append(f"  config_hash: {d.get('config_hash')}")
        lines.append(f"  data_manifest_hash: {d.get('data_manifest_hash')}")
        dirty = {True: " (dirty)", False: "", None: ""}.get(d.get("git_dirty"), "")
        lines.append(f"  git_sha: {d.get('git_sha')}{dirty}  seed: {d.get('seed')}")
    for name, entry in sorted((d.get("files") or {}).items()):
        if isinstance(entry, dict):
            lines.append(f"  {name:<22} {entry.get('size', '?'):>12} B  sha256 {entry.get('sha256')}")
    lines.append("valid: sizes, sha256 and contents verify" if d["valid"] else f"INVALID: {d['reason']}")
    return "\n".join(lines)


def render_run(d: dict) -> str:
    run = d.get("run") or {}
    status = run.get("status", "unknown") if d.get("run") is not None else f"unknown ({d.get('run_error')})"
    lines = [f"run {d['path']}", f"  status: {status}  step {run.get('step', '?')}/{run.get('total_steps', '?')}"
             f"  metrics: {_metrics(run.get('metrics'))}"]
    if not d["checkpoints"]:
        lines.append("  no checkpoints")
    for c in d["checkpoints"]:
        links = f" [{', '.join(c['links'])}]" if c["links"] else ""
        verdict = "valid" if c["valid"] else f"INVALID: {c['reason']}"
        lines.append(f"  step {c.get('step', c['listed_step']):>8}  epoch {c.get('epoch', '?')}{links}  "
                     f"{_metrics(c.get('metrics'))}  {verdict}")
    for name, link in d["links"].items():
        lines.append(f"  {name} -> {link['target']}" + ("" if link["exists"] else "  (MISSING: dangling link)"))
    if d["temporaries"]:
        lines.append(f"  ignored temporaries (an interrupted save; the next save removes them): {', '.join(d['temporaries'])}")
    return "\n".join(lines)


def is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir() or (path / "run.json").is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.inspect", description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a checkpoint directory or a run directory")
    ap.add_argument("--json", action="store_true", help="print the description as JSON")
    args = ap.parse_args(argv)
    path = args.path
    if not path.is_dir():
        print(f"inspect: {path}: not a directory", file=sys.stderr)
        return 2
    if path.name == "checkpoints" and not (path / io.MANIFEST).exists():
        path = path.parent
    d = describe_run(path) if is_run_dir(path) else describe_checkpoint(path)
    print(json.dumps(d, indent=2, sort_keys=True) if args.json else (render_run(d) if d["kind"] == "run" else render_checkpoint(d)))
    return 0 if d["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
