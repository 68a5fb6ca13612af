"""`python -m pipeline.reindex [OUTPUT_DIR] [--tracking-uri URI]`: build or complete the mlflow index from disk.

The manifests are the truth and mlflow the index over them. For every run directory under OUTPUT_DIR/runs
this finds the run's mlflow run (by the run URI its manifests recorded, else by its `run_dir` tag) or creates
it, then adds only what is missing: params (the manifest's config), tags (set to the manifest's values where
they differ), metric points from metrics.jsonl (by key and step), each checkpoint's manifest.json, the final
weights, the curves, and the status from run.json. Running it twice adds nothing.

Where mlflow and the disk disagree, the disk wins where mlflow allows it: tags and status are rewritten, a
manifest artifact whose size differs is uploaded again. mlflow cannot change a logged param or delete a metric
point, so a param whose value changed (a resume with allowed changes) is recorded as a `params_changed.<key>`
tag, and points are only ever added. A run directory still locked by a running job is skipped (its own
tracker is indexing it); one without a verified-looking checkpoint manifest is skipped too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.tracking.common import (CURVES_ARTIFACT, FINAL_MANIFEST_ARTIFACT, FINAL_WEIGHTS_ARTIFACT,
                                      default_artifact_location, default_uri, normalize_tracking_uri,
                                      params_of, parse_run_uri, tags_of)


def _default_output_dir() -> Path:
    from pipeline.schema import default_output_dir

    return Path(default_output_dir())


def _manifests(run_dir: Path) -> list[tuple[Path, dict]]:
    from pipeline.checkpoint.errors import CheckpointError
    from pipeline.checkpoint.store import read_manifest
    from pipeline.rundir import RunDir

    out = []
    for _, directory in RunDir(run_dir).store.steps():
        try:
            out.append((directory, read_manifest(directory)))
        except CheckpointError as e:
            print(f"  skipping {directory.name}: {e}", file=sys.stderr)
    return out


def _run_status(run_dir: Path) -> tuple[str | None, float | None]:
    from pipeline.rundir import RunDir
    from pipeline.tracking.store import STATUS_OF_RUN_JSON

    status = RunDir(run_dir).read_status()
    if not status:
        return None, None
    name = status.get("status")
    mlflow_status = STATUS_OF_RUN_JSON.get(name) or ("FAILED" if name == "running" else None)  # died running
    return mlflow_status, status.get("updated")


def reindex_run(client, run_dir: Path, uri: str, artifact_root: str | None) -> dict:
    """Index one run directory; returns what was added (all zeros when mlflow was already complete)."""
    from pipeline.tracking import store

    run_dir = run_dir.resolve()
    added = {"created": 0, "params": 0, "tags": 0, "points": 0, "artifacts": 0, "status": 0}
    from pipeline.rundir import RunDir

    if RunDir(run_dir).in_use():
        return {**added, "skipped": "in use by a running job"}
    manifests = _manifests(run_dir)
    if not manifests:
        return {**added, "skipped": "no checkpoint manifest"}
    newest = manifests[-1][1]
    config = newest.get("config") or {}
    lines = RunDir(run_dir).read_metrics()
    candidates = []
    for _, manifest in reversed(manifests):
        base, _, rid = parse_run_uri(manifest.get("mlflow_run_uri"))
        if rid and base in (None, uri) and rid not in candidates:
            candidates.append(rid)
    tags = tags_of(newest, run_dir)
    run = store.find_run(client, str(run_dir), candidates)
    if run is None:
        experiment = (config.get("tracking") or {}).get("experiment") or config.get("name") or "default"
        experiment_id = store.ensure_experiment(client, str(experiment), artifact_root)
        start = lines[0]["time"] if lines else (run_dir.stat().st_mtime)
        run = store.create_run(client, experiment_id, {**tags, "indexed_by": "pipeline.reindex"}, start)
        added["created"] = 1
    run_id = run.info.run_id
    added["params"] = store.sync_params(client, run, params_of(config))
    added["tags"] = store.sync_tags(client, run, tags)

    latest = {}
    for p in store.points_of(lines):
        latest[(p[0], p[3])] = p  # a step logged twice in the file: its last line
    logged = store.logged_steps(client, run_id, {k for k, _ in latest})
    added["points"] = store.log_points(client, run_id, [p for key, p in latest.items() if key not in logged])

    repo = store.artifact_repo(client, run_id)
    have = store.artifact_sizes(repo)
    todo = [(f"checkpoints/{d.name}/manifest.json", d / "manifest.json") for d, _ in manifests]
    final = RunDir(run_dir).store.link_dir("final")
    if final is not None:
        todo += [(FINAL_WEIGHTS_ARTIFACT, final / "weights.safetensors"), (FINAL_MANIFEST_ARTIFACT, final / "manifest.json")]
    for artifact, source in todo:
        if have.get(artifact) != source.stat().st_size:
            store.log_file_as(repo, artifact, source=source)
            added["artifacts"] += 1
    if (CURVES_ARTIFACT not in have or added["points"]) and store.log_curves(repo, lines):
        added["artifacts"] += 1

    status, updated = _run_status(run_dir)
    if status and client.get_run(run_id).info.status != status:
        end = int((updated or run_dir.stat().st_mtime) * 1000)
        client.set_terminated(run_id, status=status, end_time=end)
        added["status"] = 1
    return {**added, "run_id": run_id, "experiment_id": run.info.experiment_id, "status_now": status}


def reindex(output_dir: Path, uri: str | None = None, artifact_location: str | None = None,
            out=None) -> list[dict]:
    from pipeline.tracking import store
    from pipeline.tracking.common import run_uri

    out = out or sys.stdout
    output_dir = Path(output_dir).resolve()
    if uri is None:
        uri = default_uri(output_dir)
        artifact_location = artifact_location or default_artifact_location(output_dir)
    uri = normalize_tracking_uri(uri)
    client = store.open_client(uri)
    results = []
    runs_dir = output_dir / "runs"
    for run_dir in sorted(p for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.is_dir() else []:
        try:
            r = reindex_run(client, run_dir, uri, artifact_location)
        except Exception as e:  # noqa: BLE001 - one broken run does not stop the others
            r = {"error": f"{type(e).__name__}: {e}"}
        r["run_dir"] = str(run_dir)
        results.append(r)
        if "error" in r:
            print(f"{run_dir.name}: ERROR {r['error']}", file=out)
        elif "skipped" in r:
            print(f"{run_dir.name}: skipped ({r['skipped']})", file=out)
        else:
            what = ", ".join(f"+{r[k]} {k}" for k in ("params", "tags", "points", "artifacts") if r[k])
            verb = "created" if r["created"] else ("updated" if what or r["status"] else "up to date")
            if r["status"]:
                what = ", ".join(filter(None, [what, f"status {r['status_now']}"]))
            print(f"{run_dir.name}: {verb} {run_uri(uri, r['experiment_id'], r['run_id'])}"
                  + (f" ({what})" if what else ""), file=out)
    changed = sum(1 for r in results if any(r.get(k) for k in ("created", "params", "tags", "points",
                                                                     "artifacts", "status")))
    print(f"reindexed {len(results)} run directories into {uri}: {changed} changed, "
          f"{sum('error' in r for r in results)} errors", file=out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.reindex", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", default=None,
                        help="the pipeline's output directory (paths.output_dir; default: <project>/outputs)")
    parser.add_argument("--tracking-uri", default=None,
                        help="where to index (default: sqlite:///<OUTPUT_DIR>/mlflow.db)")
    parser.add_argument("--artifact-location", default=None,
                        help="artifact root for experiments it creates (default with the default URI: "
                             "<OUTPUT_DIR>/mlartifacts; otherwise the store's default)")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir) if args.output_dir else _default_output_dir()
    if not output_dir.is_dir():
        print(f"no such output directory: {output_dir}", file=sys.stderr)
        return 2
    results = reindex(output_dir, args.tracking_uri, args.artifact_location)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
