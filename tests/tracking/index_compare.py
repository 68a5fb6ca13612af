"""The comparison of a live mlflow index with one rebuilt from disk: every run, field by field."""

from __future__ import annotations

import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path

from pipeline.tracking.common import sqlite_path

# Tags that say which store a run is in, not what is on disk: left out of the comparison (the parent link and
# best.run_id are compared as the runs they name).
STORE_INTERNAL = ("mlflow.parentRunId", "best.run_id", "repeat_of", "mlflow.user")


def artifacts(client, run_id: str) -> dict[str, bytes]:
    """Every artifact of the run by relative path, downloaded through the client (any artifact store)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(client.download_artifacts(run_id, "", tmp))
        return {
            f.relative_to(root).as_posix(): f.read_bytes() for f in root.rglob("*") if f.is_file()
        }


def snapshot(uri: str, experiments: tuple[str, ...] = ()) -> dict:
    """Every run of the store (of these experiments, if named), keyed by what names it on disk (its run_dir, its
    sweep's id and job number); artifacts read through the store (a local directory or a server's)."""
    db = sqlite_path(uri)
    if db is None:
        return _snapshot(uri, experiments)
    # mlflow keeps one engine per store URI for the life of the process: a store moved aside (reindex --rebuild)
    # and made anew at the same path would be read from the old file. A copy at a path of its own is read instead.
    with (
        tempfile.TemporaryDirectory() as tmp,
        closing(sqlite3.connect(db)) as src,
        closing(sqlite3.connect(Path(tmp) / db.name)) as copy,
    ):
        src.backup(copy)
        return _snapshot(f"sqlite:///{Path(tmp) / db.name}", experiments)


def _snapshot(uri: str, experiments: tuple[str, ...]) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs(
        [
            e.experiment_id
            for e in client.search_experiments()
            if not experiments or e.name in experiments
        ],
        max_results=1000,
    )

    def key(r):
        t = r.data.tags
        if t.get("sweep") == "parent":
            return ("parent", t["sweep.id"])
        if "repeat_of" in t:
            return ("repeat", t["sweep.id"], t["sweep.job_num"])
        return ("run", t["run_dir"])

    key_of = {r.info.run_id: key(r) for r in runs}
    assert len(set(key_of.values())) == len(runs), sorted(key_of.values())
    out = {}
    for r in runs:
        tags = r.data.tags
        if "best.run_id" in tags:
            assert tags["best.run_id"] in key_of, "best.run_id names a run this store does not hold"
        out[key_of[r.info.run_id]] = {
            "params": r.data.params,
            "tags": {k: v for k, v in tags.items() if k not in STORE_INTERNAL},
            "parent": key_of.get(tags.get("mlflow.parentRunId")),
            "best": key_of.get(tags.get("best.run_id")),
            "repeat_of": key_of.get(tags.get("repeat_of")),
            "status": r.info.status,
            "start": r.info.start_time,
            "end": r.info.end_time,
            "metrics": {
                k: sorted(
                    (m.step, m.value, m.timestamp)
                    for m in client.get_metric_history(r.info.run_id, k)
                )
                for k in r.data.metrics
            },
            "artifacts": artifacts(client, r.info.run_id),
        }
    return out


def same_index(live: dict, rebuilt: dict) -> None:
    """The same runs, and every field of each equal (the first that differs named)."""
    assert sorted(rebuilt) == sorted(live), (
        sorted(set(rebuilt) - set(live)),
        sorted(set(live) - set(rebuilt)),
    )
    for key in live:
        for field in live[key]:
            got, want = rebuilt[key][field], live[key][field]
            where = (
                sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                if isinstance(got, dict) and isinstance(want, dict)
                else None
            )
            assert got == want, (
                key,
                field,
                {k: (want.get(k), got.get(k)) for k in where} if where else (want, got),
            )
