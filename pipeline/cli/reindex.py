"""`python -m pipeline.reindex [OUTPUT_DIR] [--tracking-uri URI] [--rebuild]`: the mlflow index, from disk.

Adds only what the index lacks (docs/tracking.md); exit 2: a store that will not open, 1: a run not indexed."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.cli import parser
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, CommandError
from pipeline.run.signals import command, run_command

NAME = "pipeline.reindex"
ADDED = ("params", "tags", "points", "artifacts")
INTERRUPTED = "the index may be partly updated; re-run the same command (it adds nothing twice)"


def reindex(output_dir: Path, uri: str, artifact_location: str | None = None) -> list[dict]:
    from pipeline.run.directory import RunDir
    from pipeline.run.report import run_page
    from pipeline.tracking import store
    from pipeline.tracking.common import artifact_root, run_uri
    from pipeline.tracking.index import sync_parent, sync_run

    output_dir = Path(output_dir).resolve()
    # a server's: None
    artifact_location = artifact_root(uri, artifact_location or str(output_dir / "mlartifacts"))
    client, _ = store.open_store(uri, artifact_location)
    results: list[dict] = []
    synced: dict = {}  # the sweeps' job directories, indexed with their parents already

    def page(r: dict) -> str:
        return run_page(run_uri(uri, r["experiment_id"], r["run_id"]))

    for _, kind, path in history(output_dir):
        name = f"sweep {path.name}" if kind == "sweep" else path.name
        try:
            if kind == "sweep":
                r = sync_parent(client, uri, path, artifact_location)
                synced.update(r.pop("synced"))
                print(f"{name}: {page(r)} ({r['children']} jobs, {r['status']})")
                continue
            if not (r := synced.get(str(path.resolve())) or {}) and RunDir(path).in_use():
                r = {"skipped": "in use by a running job"}
            r = r or sync_run(client, uri, path, artifact_location)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
        r[f"{kind}_dir"] = str(path)
        results.append(r)
        for reason in r.get("damaged") or ():
            print(f"{name}: not indexed, damaged: {reason}")
        if "error" in r:
            print(f"{name}: ERROR {r['error']}")
        elif "skipped" in r:
            print(f"{name}: skipped ({r['skipped']})")
        else:
            what = ", ".join(f"+{r[k]} {k}" for k in ADDED if r[k])
            verb = "created" if r["created"] else "updated" if what or r["status"] else "up to date"
            if r["status"]:
                what = ", ".join(filter(None, [what, f"status {r['status_now']}"]))
            print(f"{name}: {verb} {page(r)}" + (f" ({what})" if what else ""))
    changed = sum(any(r.get(k) for k in ("created", *ADDED, "status")) for r in results)
    errors = sum("error" in r for r in results)
    n = len(results)
    print(f"reindexed {n} run directories into {uri}: {changed} changed, {errors} errors")
    return results


def history(output_dir: Path) -> list[tuple[float, str, Path]]:
    """(start time, "sweep" or "run", directory) of each, in the order they started (unreadable: first, by name)."""
    from pipeline.run.directory import RunDir
    from pipeline.tracking.index import read_sweep

    def started(read) -> float:
        try:
            t = read().get("started")
        except Exception:
            return 0.0
        return float(t) if isinstance(t, (int, float)) else 0.0

    sweeps = sorted((output_dir / "sweeps").glob("*/sweep.json"))
    found = [(started(lambda d=p.parent: read_sweep(d)), "sweep", p.parent) for p in sweeps]
    runs = (output_dir / "runs").iterdir() if (output_dir / "runs").is_dir() else ()
    found += [(started(RunDir(p).read_status), "run", p) for p in sorted(runs) if p.is_dir()]
    return sorted(found, key=lambda f: (f[0], f[1], str(f[2])))


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    ap = parser(NAME, __doc__)
    out = "the pipeline's output directory (paths.output_dir; default: <project>/outputs)"
    ap.add_argument("output_dir", nargs="?", default=None, help=out)
    uri = "where to index (default: sqlite:///<OUTPUT_DIR>/mlflow.db)"
    ap.add_argument("--tracking-uri", default=None, help=uri)
    where = "artifact root for experiments it creates in a sqlite or file store (default: "
    where += "<OUTPUT_DIR>/mlartifacts; a tracking server chooses its own)"
    ap.add_argument("--artifact-location", default=None, help=where)
    rebuild = "move an existing sqlite store aside (never deleted) and build a new one from disk"
    ap.add_argument("--rebuild", action="store_true", help=rebuild)
    args = ap.parse_args(argv)
    from pipeline.config.compose import default_output_dir
    from pipeline.tracking.common import default_uri, normalize_tracking_uri, sqlite_path

    output_dir = Path(args.output_dir or default_output_dir())
    if not output_dir.is_dir():
        raise CommandError(f"no such output directory: {output_dir}")
    uri = normalize_tracking_uri(args.tracking_uri or default_uri(output_dir))
    if args.rebuild and (db := sqlite_path(uri)) is not None and db.exists():
        aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        db.rename(aside)  # renamed, never deleted
        print(f"moved the old store aside: {aside}")
    results = reindex(output_dir, uri, args.artifact_location)
    return EXIT_ERROR if any("error" in r for r in results) else EXIT_OK


if __name__ == "__main__":
    run_command(NAME, main, INTERRUPTED)
