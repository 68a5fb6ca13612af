"""`python -m pipeline.reindex [OUTPUT_DIR] [--tracking-uri URI] [--rebuild]`: the mlflow index, from disk.

The manifests are the truth and mlflow the index over them. For every run directory under OUTPUT_DIR/runs
this finds the run's mlflow run (by the run URI its manifests recorded, else by its `run_dir` tag) or
creates it, and adds only what is missing: params, tags (set to the disk's values where they differ, resume
history included), metric points from metrics.jsonl, the best value, checkpoint manifests, the final
weights, the composed config and the log, the curves, and the status and start and end times from run.json
(a run still marked running whose directory no process holds ended FAILED). For every sweep under
OUTPUT_DIR/sweeps it does the same for the sweep's parent run, with its jobs' runs linked under it. Running
it twice adds nothing; a run directory in use by a running job is left to that job.

In a sqlite (or file) store, new experiments keep their artifacts under OUTPUT_DIR/mlartifacts whatever
the URI names; a tracking server keeps them where it says (its --artifacts-destination). A store that
cannot be opened is one line (exit 2); `--rebuild` moves it aside (never deletes it) and builds a new one
from the disk. Exit 1 if some run directory could not be indexed.
"""
from __future__ import annotations

if __name__ == "__main__":  # first: a signal while the rest is imported ends in one line, never -15
    from pipeline.run.signals import SIGNALS_STATE

    SIGNALS_STATE.install()

import argparse
import sys
import time
from pathlib import Path

from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK


def reindex(output_dir: Path, uri: str | None = None, artifact_location: str | None = None, out=None) -> list[dict]:
    from pipeline.run.directory import RunDir
    from pipeline.tracking import store
    from pipeline.tracking.common import artifact_root, default_uri, normalize_tracking_uri, run_uri
    from pipeline.tracking.index import sync_parent, sync_run

    out = out or sys.stdout
    output_dir = Path(output_dir).resolve()
    uri = normalize_tracking_uri(uri or default_uri(output_dir))
    artifact_location = artifact_root(uri, artifact_location or str(output_dir / "mlartifacts"))  # server: None
    client = store.open_client(uri, artifact_location)
    results, synced = [], {}  # synced: the sweeps' job directories, indexed with their parents already
    for sweep_dir in sorted((output_dir / "sweeps").glob("*/sweep.json")):
        try:
            r = sync_parent(client, uri, sweep_dir.parent, artifact_location)
            synced.update(r.pop("synced"))
            print(f"sweep {sweep_dir.parent.name}: {run_uri(uri, r['experiment_id'], r['run_id'])} "
                  f"({r['children']} jobs, {r['status']})", file=out)
        except Exception as e:  # noqa: BLE001
            results.append({"error": f"{type(e).__name__}: {e}", "sweep_dir": str(sweep_dir.parent)})
            print(f"sweep {sweep_dir.parent.name}: ERROR {type(e).__name__}: {e}", file=out)
    runs_dir = output_dir / "runs"
    for run_dir in sorted(p for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.is_dir() else []:
        try:
            r = synced.get(str(run_dir.resolve())) or (
                {"skipped": "in use by a running job"} if RunDir(run_dir).in_use()
                else sync_run(client, uri, run_dir, artifact_location))
        except Exception as e:  # noqa: BLE001 - one broken run does not stop the others
            r = {"error": f"{type(e).__name__}: {e}"}
        r["run_dir"] = str(run_dir)
        results.append(r)
        for reason in r.get("damaged") or ():
            print(f"{run_dir.name}: not indexed, damaged: {reason}", file=out)
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


def move_aside(uri: str) -> Path | None:
    """The sqlite file behind `uri`, renamed to <name>.broken-<time> (never deleted); None for other URIs."""
    from pipeline.tracking.common import sqlite_path

    db = sqlite_path(uri)
    if db is None or not db.exists():
        return None
    aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    db.rename(aside)
    return aside


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.reindex", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", default=None,
                        help="the pipeline's output directory (paths.output_dir; default: <project>/outputs)")
    parser.add_argument("--tracking-uri", default=None, help="where to index (default: sqlite:///<OUTPUT_DIR>/mlflow.db)")
    parser.add_argument("--artifact-location", default=None,
                        help="artifact root for experiments it creates in a sqlite or file store (default: "
                             "<OUTPUT_DIR>/mlartifacts; a tracking server chooses its own)")
    parser.add_argument("--rebuild", action="store_true",
                        help="move an existing sqlite store aside (never deleted) and build a new one from disk")
    args = parser.parse_args(argv)
    from pipeline.config.compose import default_output_dir
    from pipeline.tracking.common import default_uri, normalize_tracking_uri
    from pipeline.tracking.store import StoreError

    output_dir = Path(args.output_dir or default_output_dir())
    if not output_dir.is_dir():
        print(f"reindex: no such output directory: {output_dir}", file=sys.stderr)
        return EXIT_BAD_INPUT
    uri = normalize_tracking_uri(args.tracking_uri or default_uri(output_dir))
    if args.rebuild and (aside := move_aside(uri)) is not None:
        print(f"moved the old store aside: {aside}")
    try:
        results = reindex(output_dir, uri, args.artifact_location)
    except StoreError as e:
        print(f"reindex: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_ERROR if any("error" in r for r in results) else EXIT_OK


if __name__ == "__main__":
    from pipeline.run.signals import tool_exit

    tool_exit("reindex", main, "the index may be partly updated; re-run the same command (it adds nothing twice)")
