"""A run directory (or a sweep) into the mlflow index from the disk, the truth: for the agent and reindex alike."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import Any

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.checkpoint.errors import CheckpointError
from pipeline.files import jsonio, reading
from pipeline.files.limits import MAX_COMPARED_BYTES, MAX_CURVES_BYTES, MAX_SWEEP_JSON
from pipeline.run.directory import RunBusyError, RunDir
from pipeline.sweep.summary import best_job, direction, finite, parent_name, read_jobs
from pipeline.tracking import common, store
from pipeline.trainer import curves

STATUS_OF_RUN_JSON = {"complete": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}


def ids_of(run) -> dict:
    return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id}


def _bytes_of(source: Path | bytes) -> bytes:
    """A small artifact's bytes: a FIFO, a device or a file grown past the bound since its stat is refused."""
    if isinstance(source, bytes):
        return source
    with reading.open_file(source, MAX_COMPARED_BYTES, follow=True) as f:
        return f.read(MAX_COMPARED_BYTES + 1)


def manifests(rundir: RunDir) -> tuple[list[tuple[Path, dict]], list[str]]:
    """([(directory, manifest)] of every checkpoint whose manifest reads, [why each other one does not])."""
    out, damaged = [], []
    for _, directory in rundir.store.steps():
        try:
            out.append((directory, CheckpointDir(directory).manifest()))
        except CheckpointError as e:
            damaged.append(str(e))
    return out, damaged


def best_metrics(directory: Path) -> dict[str, tuple[float, int]]:
    """{"best/<monitor>" and "best/step": (value, step)} from the best-val stages' state in a checkpoint."""
    try:
        manifest, extra = CheckpointDir(directory).json_state()
    except (OSError, CheckpointError):
        return {}
    config = manifest["config"]
    out = {}
    for name, state in (extra.get("stages") or {}).items():
        node = (config.get("stages") or {}).get(name) or {}
        if isinstance(state, dict) and state.get("best") is not None and "monitor" in node:
            out[f"best/{node['monitor']}"] = (jsonio.number(state["best"]), int(state["best_step"]))
    if out:  # the step of the best (of the first best-val stage)
        step = next(iter(out.values()))[1]
        out["best/step"] = (float(step), step)
    return out


def sync_run(client, uri, run_dir: Path, root, parent=None, job=None, artifacts=True, repeat=False):
    """Make run_dir's mlflow run hold what the directory does, under `parent` (repeat: if another job's, a child)."""
    run_dir = Path(run_dir).resolve()
    rundir = RunDir(run_dir)
    found, damaged = manifests(rundir)
    counts = ("created", "params", "tags", "points", "artifacts", "status")
    added: dict[str, Any] = {**dict.fromkeys(counts, 0), "damaged": damaged}
    named = [manifest.get("mlflow_run_uri") for _, manifest in reversed(found)]  # newest first
    run = store.find_run(client, str(run_dir), uri, named) if found or repeat else None
    if repeat and parent and run is not None:
        tags = run.data.tags
        own = tags.get("mlflow.parentRunId") == parent["run_id"]
        if not own or tags.get("sweep.job_num") not in (None, str(job.get("num"))):
            return repeat_child(client, run, parent, job)
    if not found:
        return {**added, "skipped": "no checkpoint manifest"}
    newest = found[-1][1]
    config, status, lines = newest.get("config") or {}, rundir.read_status(), rundir.read_metrics()
    tags, params = common.tags_of(newest, run_dir, status, job), common.params_of(config)
    started = status.get("started") or (lines[0]["time"] if lines else run_dir.stat().st_mtime)
    experiment = (common.experiment_of(config), root)
    run, opened = open_run(client, run, tags, params, parent, started, experiment)
    added, run_id = {**added, **opened}, run.info.run_id
    # (key, step) -> its point; a step logged twice in the file: its last line
    latest = {(p[0], p[3]): p for line in lines for p in common.metric_points(line)}
    # The best is the run's result: logged once it has ended for good, never from a preempted segment (a resumed
    # run's index would keep that segment's best beside the final one, which a rebuild from disk cannot know).
    best = best_metrics(found[-1][0]) if status.get("status") != "preempted" else {}
    when = {p[3]: p[2] for p in latest.values()}  # step -> its time: the same in every rebuild
    for key, (value, step) in best.items():
        latest[(key, step)] = (key, value, when.get(step, 0), step)
    added["points"] = store.log_points(client, run_id, list(latest.values()), new_only=True)
    name = str(status.get("status"))
    died = name == "running" and not rundir.in_use()  # nobody in the run directory: it died running
    mstatus = "FAILED" if died else STATUS_OF_RUN_JSON.get(name)
    if mstatus and client.get_run(run_id).info.status != mstatus:
        end = status.get("ended_at") or status.get("updated") or run_dir.stat().st_mtime
        client.set_terminated(run_id, status=mstatus, end_time=int(end * 1000))
        added["status"] = 1
    # The run directory points at its own store (its newest manifest naming one, else run.json's, else this one):
    # an index built in another store (a copy, a colleague's server) reads the directory and leaves it as it was.
    stores = (common.parse_run_uri(u)[0] for u in [*named, status.get("mlflow_run_uri")])
    if next(filter(None, stores), None) in (None, uri):
        record_run_uri(rundir, common.run_uri(uri, run.info.experiment_id, run_id))
    if artifacts:
        added["artifacts"] = sync_artifacts(client, run_id, run_dir, found, lines)
    return {**added, **ids_of(run), "status_now": mstatus}


def open_run(client, run, tags, params, parent, started, experiment, created_tags=None) -> tuple:
    """`run` (None: made in parent's experiment, else experiment=(name, root)'s) under `parent` unless another's."""
    if parent is not None:
        tags = {**tags, "mlflow.parentRunId": parent["run_id"]}
    if created := run is None:
        made = {**tags, **(created_tags or {})}
        where = parent["experiment_id"] if parent else store.ensure_experiment(client, *experiment)
        run = store.create_run(client, where, made, started)
    first = run.data.tags.get("mlflow.parentRunId")
    if first not in (None, tags.get("mlflow.parentRunId")):
        tags = {k: v for k, v in tags.items() if not k.startswith("sweep.")}
        tags.pop("mlflow.runName", None)
        tags["mlflow.parentRunId"] = first
    added = {"created": int(created), "params": store.sync_params(client, run, params)}
    return run, {**added, "tags": store.sync_tags(client, run, tags, common.DERIVED_RUN_TAGS)}


def record_run_uri(rundir: RunDir, uri: str) -> None:
    """run.json names the run's mlflow run (its manifests may say null), under the run's lock: never beside a job."""
    # nothing to link (no run.json: never made here), or linked already
    if not (status := rundir.read_status()) or status.get("mlflow_run_uri") == uri:
        return
    try:
        rundir.acquire()
    except (RunBusyError, OSError):
        return
    try:
        status = rundir.read_status()  # again, under the lock
        if status and status.get("mlflow_run_uri") != uri:
            status.pop("updated", None)
            rundir.write_status(**{**status, "mlflow_run_uri": uri})
    finally:
        rundir.release()


def sync_artifacts(client, run_id: str, run_dir: Path, found=None, lines=None) -> int:
    """The artifacts part of sync_run (for the agent, once sync_run(artifacts=False) has done the rest)."""
    rundir = RunDir(Path(run_dir).resolve())
    found = manifests(rundir)[0] if found is None else found
    repo = store.artifact_repo(client, run_id)
    have = store.artifact_sizes(repo)
    final = rundir.store.link_dir("final")
    todo: list[tuple[str, Path | bytes]] = []
    checkpoints = [(d.relative_to(rundir.path).as_posix(), d) for d, _ in found]
    for folder, directory in checkpoints + ([("final", final)] if final else []):
        try:  # CheckpointDir reads a checkpoint's files: never a link or a FIFO
            name, raw = CheckpointDir(directory).manifest_file()
            todo.append((f"{folder}/{name}", raw))
            if folder == "final":  # after its manifest: the weights are logged again when it is
                weights = CheckpointDir(directory).weights_file()
                todo.append((f"final/{weights.name}", weights))
        except (OSError, CheckpointError):
            continue  # a damaged checkpoint: reindex names it
    todo += [(f"hydra/{n}", rundir.hydra_dir / n) for n in ("config.yaml", "overrides.yaml")]
    todo.append((rundir.log_path.name, rundir.log_path))
    if (png := curves_png(rundir, rundir.read_metrics() if lines is None else lines)) is not None:
        todo.append((common.CURVES_ARTIFACT, png))
    # A checkpoint retention retired is gone from disk: its manifest, logged live, goes from the index too (a
    # rebuild never sees it; resume.N tags keep where each resume started). A damaged one is on disk: kept.
    kept = {d.name for _, d in rundir.store.steps()}
    folder = rundir.store.root.relative_to(rundir.path).as_posix()  # as in the run's layout
    logged = {a.split("/")[1] for a in have if a.startswith(f"{folder}/") and a.count("/") == 2}
    for name in sorted(logged - kept):
        repo.delete_artifacts(f"{folder}/{name}")
    return log_changed(repo, have, todo)


def log_changed(repo, have: dict[str, int], todo: list[tuple[str, Path | bytes]]) -> int:
    """Log each (artifact, bytes or regular file) whose size or small content differs from the run's; how many."""
    added, final_changed = 0, False
    for artifact, source in todo:
        try:
            if not isinstance(source, bytes) and not stat.S_ISREG(source.stat().st_mode):
                continue
            size = len(source) if isinstance(source, bytes) else source.stat().st_size
            # a size the store does not list (None) differs; only a listed same size is read back
            changed = have.get(artifact) != size
            if not changed and size <= MAX_COMPARED_BYTES:
                changed = store.artifact_bytes(repo, artifact) != _bytes_of(source)
        except OSError:
            continue  # absent, or replaced since it was listed (a FIFO, a device, a file grown past the bound)
        final = artifact.startswith("final/")
        if changed or (final_changed and final):
            final_changed = final_changed or final  # the weights follow their manifest
            store.log_file_as(repo, artifact, source)
            added += 1
    return added


def curves_png(rundir: RunDir, lines: list) -> bytes | None:
    """The run directory's own curves.png if written after the last metrics line, else drawn from metrics.jsonl."""
    own = rundir.path / common.CURVES_ARTIFACT
    with contextlib.suppress(OSError):  # a link, a FIFO or a file over the bound: drawn again
        if own.stat().st_mtime >= rundir.metrics_path.stat().st_mtime:
            return reading.read_bytes(own, MAX_CURVES_BYTES)
    return curves.draw(lines)  # the job's own drawing: the same lines give the same bytes


SWEEP_STATUS = dict(complete="FINISHED", failed="FAILED", interrupted="KILLED", running="RUNNING")
# Parent tags that follow the jobs (best.: all best.*): removed when the disk no longer says them.
DERIVED_PARENT_TAGS = ("sweep.failures", "ended", "best.")


def read_sweep(sweep_dir: Path) -> dict:
    return jsonio.read(Path(sweep_dir) / "sweep.json", MAX_SWEEP_JSON)


def identity_tags(sweep: dict) -> dict[str, str]:
    """The parent's tags that sweep.json fixes when the sweep starts (the same whoever creates the run)."""
    tags = {"mlflow.runName": parent_name(sweep.get("swept") or {}), "sweep": "parent"}
    tags |= {"sweep.id": sweep["id"], "sweep.dir": str(sweep.get("dir", ""))}
    tags["sweep.overrides"] = " ".join(sweep.get("overrides") or [])
    tags |= {f"sweep.{k}": sweep.get(k, "") for k in ("launcher", "sweeper")}
    tags |= {"mlflow.source.name": "pipeline -m", "experiment": sweep.get("name", "")}
    tags["git_sha"] = str(sweep.get("git_sha"))
    if sweep.get("git_sha") not in (None, "unknown"):
        tags["mlflow.source.git.commit"] = sweep["git_sha"]
    return {k: common.tag_value(v) for k, v in tags.items()}


def parent_tags(client, sweep: dict, jobs: dict[int, dict]) -> tuple[dict[str, str], str]:
    """A sweep's parent run's tags and mlflow status, from sweep.json and jobs/*.json (best.run_id: in THIS store)."""
    tags = identity_tags(sweep)
    failed = {n: j for n, j in sorted(jobs.items()) if j.get("status") != "complete"}
    tags.update({"sweep.jobs": str(len(jobs)), "sweep.failed": str(len(failed))})
    if failed:
        said = [
            f"job {n} ({j.get('name', '')}): {j.get('status')}: {j.get('error', '')}"
            for n, j in failed.items()
        ]
        tags["sweep.failures"] = common.tag_value("; ".join(said))
    if (best := best_job(jobs, sweep)) is not None:
        tags["best.job"], tags["best.value"] = str(best["num"]), repr(best["objective"])
        tags["best.params"] = common.tag_value(best.get("name", ""))
        # by its run_dir tag: a run id the job recorded may be another store's
        if (d := best.get("run_dir")) and (found := store.find_run(client, str(Path(d).resolve()))):
            tags["best.run_id"] = found.info.run_id
    status = SWEEP_STATUS.get(sweep.get("status", "running"), "RUNNING")
    # running, but its launching process (seen from its own host: elsewhere it is taken as alive) has died
    here = sweep.get("host") == socket.gethostname() and isinstance(sweep.get("pid"), int)
    if status == "RUNNING" and here:
        with contextlib.suppress(PermissionError):
            try:
                os.kill(sweep["pid"], 0)
            except ProcessLookupError:
                tags["ended"] = "the launching process exited without ending the sweep"
                status = "FAILED"
    return tags, status


def objective_points(sweep: dict, jobs: dict[int, dict]) -> list[tuple[str, float, int, int]]:
    """The parent's objective: at step n, the best of jobs 0..n, up to the first job not complete (then final)."""
    key, maximize = sweep.get("objective", "objective"), direction(sweep) == "maximize"
    ts, best, out = int(float(sweep.get("started") or 0) * 1000), None, []
    for n in sorted(jobs):
        job = jobs[n]
        if job.get("status") != "complete":
            break
        if (value := finite(job.get("objective"))) is not None:
            best = value if best is None else (max if maximize else min)(best, value)
        if best is not None:
            out.append((key, best, ts, n))
    return out


def open_parent(client, sweep_dir: Path, artifact_root: str | None):
    """(the sweep's parent run, found by the sweep's id or created now; whether created), as sweep.json says."""
    sweep = read_sweep(sweep_dir)
    experiment = sweep.get("experiment") or sweep.get("name") or "default"
    experiment_id = store.ensure_experiment(client, experiment, artifact_root)
    found = store.find_parent(client, sweep["id"], experiment_id)
    tags = identity_tags(sweep)
    run = found or store.create_run(client, experiment_id, tags, sweep.get("started"))
    store.sync_tags(client, run, tags)
    swept = {k: common.param_value(v) for k, v in (sweep.get("swept") or {}).items()}
    store.sync_params(client, run, swept)
    return client.get_run(run.info.run_id), found is None


def repeat_child(client, run, parent: dict, job: dict) -> dict:
    """The child of `parent` for a sweep job whose run directory is `run`'s, another job's (made once)."""
    tags = run.data.tags
    # The child is named by the run directory it repeats, as on disk (a run id is the store's own: a rebuild makes
    # others), holds its params and final metrics, and no run_dir tag (that one is the run).
    same = Path(tags.get("run_dir") or run.info.run_id).name
    name = f"{job.get('name') or tags.get('mlflow.runName', '')} (same run as {same})"
    kept = {k: v for k, v in tags.items() if not k.startswith(("mlflow.", "sweep."))}
    kept.pop("run_dir", None)
    repeat = {"repeat_of": run.info.run_id, "repeat_of.run_dir": tags.get("run_dir", "")}
    tags = {**kept, "mlflow.parentRunId": parent["run_id"], "mlflow.runName": name, **repeat}
    tags |= {k: str(v) for k, v in common.job_tags(job).items()}
    where = f"tags.`sweep.id` = '{job.get('sweep_id')}' and tags.repeat_of = '{run.info.run_id}'"
    where += f" and tags.`sweep.job_num` = '{job.get('num')}'"
    found = client.search_runs([parent["experiment_id"]], where, max_results=1)
    # its times and points are the run's it repeats: the same in the live index and in a rebuild
    if not (child := found[0] if found else None):
        start, experiment = run.info.start_time, parent["experiment_id"]
        child = client.create_run(experiment, start_time=start, tags=tags, run_name=name)
        store.sync_params(client, child, run.data.params)
        end = run.info.end_time or run.info.start_time
        points = [(k, v, end, 0) for k, v in sorted(run.data.metrics.items())]
        store.log_points(client, child.info.run_id, points)
        client.set_terminated(child.info.run_id, status=run.info.status, end_time=end)
    return {**ids_of(child), "repeat_of": run.info.run_id}


def sync_parent(client, uri, sweep_dir: Path, artifact_root, parent=None, children=True) -> dict:
    """Make a sweep's parent run hold what its directory says; children=True (reindex): each job's run directory too."""
    sweep_dir = Path(sweep_dir)
    sweep, jobs = read_sweep(sweep_dir), read_jobs(sweep_dir)
    if parent is None:
        parent = ids_of(open_parent(client, sweep_dir, artifact_root)[0])
    synced = {}
    for _num, job in sorted(jobs.items()) if children else ():
        run_dir = job.get("run_dir")
        if run_dir and Path(run_dir).is_dir() and not RunDir(run_dir).in_use():
            r = sync_run(client, uri, Path(run_dir), artifact_root, parent, job, repeat=True)
            if "repeat_of" not in r:
                synced[str(Path(run_dir).resolve())] = r
    run = client.get_run(parent["run_id"])
    tags, status = parent_tags(client, sweep, jobs)
    store.sync_tags(client, run, tags, DERIVED_PARENT_TAGS)
    store.log_points(client, run.info.run_id, objective_points(sweep, jobs), new_only=True)
    repo = store.artifact_repo(client, run.info.run_id)
    names = ("multirun.yaml", "optimization_results.yaml", "sweep.json")
    log_changed(repo, store.artifact_sizes(repo), [(n, sweep_dir / n) for n in names])
    end = int(ended * 1000) if isinstance(ended := sweep.get("ended_at"), (int, float)) else None
    if status != "RUNNING" and (run.info.status != status or run.info.end_time != end):
        client.set_terminated(run.info.run_id, status=status, end_time=end)
    return {**parent, "children": len(jobs), "status": status, "synced": synced}
