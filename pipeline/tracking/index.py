"""One run directory (or one sweep) into the mlflow index, from what is on disk: the same code for the live
agent at a run's end and for `pipeline.reindex`, so a run indexed live and re-indexed later look the same.

The disk is the truth and mlflow the index: tags and status follow the disk; mlflow cannot change a logged
param or delete a metric point, so a changed param becomes a `params_changed.<key>` tag and points are
only ever added. Every function adds only what is missing: running it twice adds nothing. Imports mlflow.
"""
from __future__ import annotations

import time
from pathlib import Path

from pipeline import jsonio
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.store import EXTRA, MANIFEST, WEIGHTS, read_manifest
from pipeline.rundir import RunBusyError, RunDir
from pipeline.tracking import store
from pipeline.tracking.common import (CURVES_ARTIFACT, FINAL_MANIFEST_ARTIFACT, FINAL_WEIGHTS_ARTIFACT, params_of,
                                      parse_run_uri, run_uri, tags_of)

STATUS_OF_RUN_JSON = {"complete": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}


def manifests(rundir: RunDir) -> list[tuple[Path, dict]]:
    out = []
    for _, directory in rundir.store.steps():
        try:
            out.append((directory, read_manifest(directory)))
        except CheckpointError:
            pass
    return out


def mlflow_status(rundir: RunDir, status: dict) -> str | None:
    name = status.get("status")
    if name == "running" and not rundir.in_use():
        return "FAILED"  # the process died running
    return STATUS_OF_RUN_JSON.get(name)


def best_metrics(directory: Path) -> dict[str, tuple[float, int]]:
    """{"best/<monitor>": (value, step)} from the best-val stages' state in a checkpoint's extra.json."""
    try:
        extra = jsonio.read(directory / EXTRA, 16 << 20)
        config = read_manifest(directory)["config"]
    except (OSError, ValueError, CheckpointError):
        return {}
    out = {}
    for name, state in (extra.get("stages") or {}).items():
        node = (config.get("stages") or {}).get(name) or {}
        if isinstance(state, dict) and state.get("best") is not None and "monitor" in node:
            out[f"best/{node['monitor']}"] = (jsonio.number(state["best"]), int(state["best_step"]))
    return out


def find_or_create(client, uri: str, run_dir: Path, experiment: str, artifact_root: str | None, candidates: list,
                   tags: dict, start_time: float):
    run = store.find_run(client, str(run_dir), candidates)
    if run is not None:
        return run, False
    experiment_id = store.ensure_experiment(client, experiment, artifact_root)
    return store.create_run(client, experiment_id, tags, start_time), True


def sync_run(client, uri: str, run_dir: Path, artifact_root: str | None, parent: dict | None = None,
             job: dict | None = None, artifacts: bool = True) -> dict:
    """Make the mlflow run of `run_dir` hold everything the directory does; returns what was added.

    `parent` ({"run_id", "experiment_id"}) links it under a sweep's parent run (a run already under
    another parent keeps it); `job` adds the sweep job's tags (name of swept values, overrides, number).
    The run is complete (params, tags, every point, its status) before its artifacts are logged; with
    artifacts=False they are left to sync_run_artifacts (the agent completes every waiting run first).
    """
    run_dir = Path(run_dir).resolve()
    rundir = RunDir(run_dir)
    added = {"created": 0, "params": 0, "tags": 0, "points": 0, "artifacts": 0, "status": 0}
    found = manifests(rundir)
    if not found:
        return {**added, "skipped": "no checkpoint manifest"}
    newest = found[-1][1]
    config = newest.get("config") or {}
    status = rundir.read_status()
    lines = rundir.read_metrics()
    candidates = []
    for _, manifest in reversed(found):
        base, _, rid = parse_run_uri(manifest.get("mlflow_run_uri"))
        if rid and base in (None, uri) and rid not in candidates:
            candidates.append(rid)
    tags = tags_of(newest, run_dir, status, job)
    if parent is not None:
        tags["mlflow.parentRunId"] = parent["run_id"]
    experiment = (config.get("tracking") or {}).get("experiment") or config.get("name") or "default"
    started = status.get("started") or (lines[0]["time"] if lines else run_dir.stat().st_mtime)
    run, created = find_or_create(client, uri, run_dir, str(experiment), artifact_root, candidates, tags, started)
    added["created"] = int(created)
    if run.data.tags.get("mlflow.parentRunId") not in (None, tags.get("mlflow.parentRunId")):
        # it stays with its first sweep (and that sweep's job name and number)
        tags = {k: v for k, v in tags.items() if not k.startswith("sweep.") and k != "mlflow.runName"}
        tags["mlflow.parentRunId"] = run.data.tags["mlflow.parentRunId"]
    run_id = run.info.run_id
    added["params"] = store.sync_params(client, run, params_of(config))
    added["tags"] = store.sync_tags(client, run, tags)
    latest = {}
    for p in store.points_of(lines):
        latest[(p[0], p[3])] = p  # a step logged twice in the file: its last line
    best = best_metrics(found[-1][0])
    for key, (value, step) in best.items():
        latest[(key, step)] = (key, value, int(time.time() * 1000), step)
    if best:
        step = next(iter(best.values()))[1]
        latest[("best/step", step)] = ("best/step", float(step), int(time.time() * 1000), step)
    logged = store.logged_steps(client, run_id, {k for k, _ in latest})
    added["points"] = store.log_points(client, run_id, [p for key, p in latest.items() if key not in logged])
    mstatus = mlflow_status(rundir, status)
    if mstatus and client.get_run(run_id).info.status != mstatus:
        end = status.get("ended_at") or status.get("updated") or run_dir.stat().st_mtime
        client.set_terminated(run_id, status=mstatus, end_time=int(end * 1000))
        added["status"] = 1
    record_run_uri(rundir, run_uri(uri, run.info.experiment_id, run_id))
    if artifacts:
        added["artifacts"] = sync_artifacts(client, run_id, rundir, found, lines, bool(added["points"]))
    return {**added, "run_id": run_id, "experiment_id": run.info.experiment_id, "status_now": mstatus}


def sync_run_artifacts(client, run_id: str, run_dir: Path, new_points: bool = False) -> int:
    """The artifacts part of sync_run, for a run whose rest sync_run(artifacts=False) has done."""
    rundir = RunDir(Path(run_dir).resolve())
    return sync_artifacts(client, run_id, rundir, manifests(rundir), rundir.read_metrics(), new_points)


def record_run_uri(rundir: RunDir, uri: str) -> bool:
    """run.json names the run's mlflow run (`mlflow_run_uri`): the disk's link to the index, also when the
    manifests were written before the URI was known (they say null). Written by whoever holds the run's lock
    (never beside a running job: it rewrites run.json); False, changing nothing, if a job holds it now."""
    status = rundir.read_status()
    if not status or status.get("mlflow_run_uri") == uri:
        return True  # nothing to link (no run.json: never made here), or linked already
    try:
        rundir.acquire()
    except (RunBusyError, OSError):
        return False
    try:
        status = rundir.read_status()  # again, under the lock
        if status and status.get("mlflow_run_uri") != uri:
            status.pop("updated", None)
            rundir.write_status(**{**status, "mlflow_run_uri": uri})
    finally:
        rundir.release()
    return True


def sync_artifacts(client, run_id: str, rundir: RunDir, found: list, lines: list, new_points: bool) -> int:
    repo = store.artifact_repo(client, run_id)
    have = store.artifact_sizes(repo)
    todo = [(f"checkpoints/{d.name}/{MANIFEST}", d / MANIFEST) for d, _ in found]
    final = rundir.store.link_dir("final")
    if final is not None:
        todo += [(FINAL_WEIGHTS_ARTIFACT, final / WEIGHTS), (FINAL_MANIFEST_ARTIFACT, final / MANIFEST)]
    for p in (rundir.hydra_dir / "config.yaml", rundir.hydra_dir / "overrides.yaml"):
        todo.append((f"hydra/{p.name}", p))
    todo.append((rundir.log_path.name, rundir.log_path))
    added = 0
    for artifact, source in todo:
        try:
            size = source.stat().st_size
        except OSError:
            continue
        if have.get(artifact) != size:
            store.log_file_as(repo, artifact, source=source)
            added += 1
    if (CURVES_ARTIFACT not in have or new_points) and store.log_curves(repo, lines):
        added += 1
    return added


SWEEP_STATUS = {"complete": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "running": "RUNNING"}


def sync_parent(client, uri: str, sweep_dir: Path, artifact_root: str | None, parent: dict | None = None,
                children: bool = True) -> dict:
    """Make a sweep's parent run hold what its directory says (sweep.json, jobs/*.json, multirun.yaml, the
    sweeper's results): found by the sweep's id or created; with children=True (reindex) every job's run
    directory is indexed under it too. Returns {"run_id", "experiment_id", "children", "status", "synced":
    {resolved run directory: sync_run's result}}."""
    from pipeline.tracking.sweep_callback import best_job, read_jobs

    sweep_dir = Path(sweep_dir)
    sweep = jsonio.read(sweep_dir / "sweep.json", 1 << 24)
    jobs = read_jobs(sweep_dir)
    experiment = sweep.get("experiment") or sweep.get("name") or "default"
    experiment_id = store.ensure_experiment(client, experiment, artifact_root)
    if parent is None:
        found = store.find_parent(client, sweep["id"], experiment_id)
        tags = {"mlflow.runName": f"sweep {sweep.get('name', '')} {' '.join(sweep.get('swept') or {})}".strip(),
                "sweep": "parent", "sweep.id": sweep["id"], "sweep.dir": str(sweep_dir),
                "sweep.overrides": " ".join(sweep.get("overrides") or []), "mlflow.source.name": "pipeline -m",
                "sweep.launcher": sweep.get("launcher", ""), "sweep.sweeper": sweep.get("sweeper", ""),
                "experiment": sweep.get("name", "")}
        run = found or store.create_run(client, experiment_id, tags, sweep.get("started"))
        parent = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id}
        store.sync_params(client, run, {k: str(v)[:6000] for k, v in (sweep.get("swept") or {}).items()})
    synced = {}
    if children:
        for job in jobs.values():
            if job.get("run_dir") and Path(job["run_dir"]).is_dir() and not RunDir(job["run_dir"]).in_use():
                synced[str(Path(job["run_dir"]).resolve())] = sync_run(
                    client, uri, Path(job["run_dir"]), artifact_root, parent,
                    {k: job.get(k) for k in ("sweep_id", "num", "overrides", "name")})
    run = client.get_run(parent["run_id"])
    failed = {n: j for n, j in sorted(jobs.items()) if j.get("status") != "complete"}
    tags = {"sweep.jobs": str(len(jobs)), "sweep.failed": str(len(failed))}
    if failed:
        tags["sweep.failures"] = "; ".join(f"job {n} ({j.get('name', '')}): {j.get('status')}: {j.get('error', '')}"
                                           for n, j in failed.items())[:8000]
    best = best_job(jobs, sweep.get("direction", "minimize"))
    objective = sweep.get("objective", "objective")
    if best is not None:
        tags.update({"best.job": str(best["num"]), "best.params": best.get("name", ""),
                     "best.value": repr(best["objective"])})
        best_id = parse_run_uri(best.get("run_uri"))[2]
        if best_id is None and best.get("run_dir"):  # its job ended before its run's URI was known
            found = store.find_run(client, str(Path(best["run_dir"]).resolve()))
            best_id = found.info.run_id if found is not None else None
        if best_id:
            tags["best.run_id"] = best_id
    store.sync_tags(client, run, tags)
    if best is not None and run.data.metrics.get(objective) != best["objective"]:
        store.log_points(client, run.info.run_id, [(objective, float(best["objective"]),
                                                    int(time.time() * 1000), 0)])
    repo = store.artifact_repo(client, run.info.run_id)
    have = store.artifact_sizes(repo)
    for name in ("multirun.yaml", "optimization_results.yaml", "sweep.json"):
        p = sweep_dir / name
        if p.is_file() and have.get(name) != p.stat().st_size:
            store.log_file_as(repo, name, source=p)
    status = SWEEP_STATUS.get(sweep.get("status", "running"), "RUNNING")
    if status == "RUNNING" and not _alive(sweep):
        status = "FAILED"  # its launching process died without ending it
        store.sync_tags(client, run, {"ended": "the launching process exited without ending the sweep"})
    if status != "RUNNING" and run.info.status != status:
        client.set_terminated(run.info.run_id, status=status,
                              end_time=int((sweep.get("ended_at") or time.time()) * 1000))
    return {**parent, "children": len(jobs), "status": status, "synced": synced}


def _alive(sweep: dict) -> bool:
    """Whether the process that launched a sweep still runs (a sweep launched on another host: assume so)."""
    import os
    import socket

    if sweep.get("host") != socket.gethostname() or not isinstance(sweep.get("pid"), int):
        return True
    try:
        os.kill(sweep["pid"], 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
