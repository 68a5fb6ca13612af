"""The mlflow side of the index (imports mlflow: never from the training process): stores, runs, what is missing."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import sqlite3
import tempfile
import time
from contextlib import closing, contextmanager, nullcontext, suppress
from functools import cache
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException

from pipeline.config.errors import CommandError
from pipeline.files.atomic import UnsafePathError, refuse_link
from pipeline.files.limits import MAX_ARTIFACT, MAX_MOUNTS_BYTES
from pipeline.tracking import common

log = logging.getLogger("pipeline")
METRICS_PER_BATCH, PARAMS_PER_BATCH, TAGS_PER_BATCH = 1000, 100, 100
# A down server fails in seconds, not minutes; mlflow prints no download bars or "View run" lines. mlflow reads
# these at each use, so open_store sets them (unless the user did) where a client is opened, never on import.
HTTP_SETTINGS = dict(MLFLOW_HTTP_REQUEST_MAX_RETRIES="2", MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1")
HTTP_SETTINGS.update(MLFLOW_HTTP_REQUEST_TIMEOUT="20", MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
HTTP_SETTINGS.update(MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true")
# Filesystems whose locks sqlite cannot trust (its own documentation warns against sharing a file over them).
NETWORK_FS: tuple[str, ...] = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs")
NETWORK_FS += ("ceph", "9p", "afs", "fuse.glusterfs", "glusterfs", "fuse.cephfs", "fuse.sshfs")
NETWORK_FS += ("panfs", "orangefs", "pvfs2", "ocfs2", "gfs2")
MOUNTS = Path("/proc/mounts")
HOSTS_TAG = "pipeline.hosts"  # on the store's Default experiment: every host that opened it, comma-separated
MAX_HOSTS = 50
TEAM_SETUP = "run `mlflow server --backend-store-uri postgresql+psycopg://USER@DBHOST/DB --artifacts-destination "
TEAM_SETUP += "DIR --host HOST --port 5000 --allowed-hosts HOST:5000` and track with "
TEAM_SETUP += "`tracking=server tracking.uri=http://HOST:5000` (docs/tracking.md: Team setup)"


@cache
def _quiet_migrations() -> None:
    """mlflow's and alembic's migration lines at INFO, quieted where a store is first opened, never on import."""
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def forget_store(uri: str) -> None:
    """Drop mlflow's engine, pooled connections and stores of `uri`: a sqlite file replaced since is opened anew."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service import utils

    if (engine := SqlAlchemyStore._engine_map.pop(uri, None)) is not None:  # one per URI, for life
        engine.dispose()
    utils._tracking_store_registry._get_store_with_resolved_uri.cache_clear()  # the stores, per URI


class StoreError(CommandError):
    """An mlflow store that cannot be opened or written (one line: where, why, and what to do)."""


@contextmanager
def _flock(path: Path, flags: int):
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def template_db() -> Path | None:
    """A migrated, empty sqlite store per mlflow version, made once under a lock: a fresh store is a copy of it."""
    _quiet_migrations()
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipeline"
    path = base / f"mlflow-{mlflow.__version__}-empty.db"
    if path.is_file():
        return path
    try:
        base.mkdir(parents=True, exist_ok=True)
        with _flock(base / f"{path.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC):
            if not path.is_file():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.unlink(missing_ok=True)
                db = f"sqlite:///{tmp}"
                SqlAlchemyStore(db, (base / "no-artifacts").as_uri()).engine.dispose()
                with closing(sqlite3.connect(tmp)) as con, con:
                    con.execute("DELETE FROM experiments")  # the Default one: each copy its own
                os.replace(tmp, path)  # whole or absent
        return path
    except Exception:
        log.debug("no migrated mlflow store template in %s", base, exc_info=True)
        return None


def _copy_template(db: Path) -> None:
    """Put a copy of the template at `db` (under the store's lock), never over an existing file."""
    if (template := template_db()) is None:
        return
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(template, tmp)
        os.link(tmp, db)  # fails if db exists: never over an existing DB
    except OSError:
        pass  # it exists after all, or no hard links here: mlflow creates and migrates it in place
    finally:
        tmp.unlink(missing_ok=True)


def open_store(uri: str, artifact_root: str | None = None) -> tuple[MlflowClient, str | None]:
    """(A client of the open store, its check_shared warning or None); a new sqlite store is made under the lock."""
    _quiet_migrations()
    for key, value in HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)
    db = common.sqlite_path(uri)
    try:
        if db is not None:
            # a link planted at the store or beside it would create or fill a store elsewhere
            refuse_link(db)
            refuse_link(db.parent / "mlartifacts", "directory")
            # the slow import, outside the lock
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            db.parent.mkdir(parents=True, exist_ok=True)
            if not db.exists():
                template_db()  # made (once per machine) outside this store's lock
        # One process at a time creates, migrates or opens a sqlite store (two migrations at once leave it
        # half-migrated): an flock on its directory, taken before any mlflow object touches the DB.
        with _flock(db.parent, os.O_RDONLY | os.O_DIRECTORY) if db is not None else nullcontext():
            if db is not None and not db.exists():
                _copy_template(db)
                SqlAlchemyStore(uri, common.artifact_root(uri, artifact_root))
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)  # connect now: a server that is down fails
            warning = check_shared(client, db) if db is not None else None
        return client, warning
    except UnsafePathError as e:
        raise StoreError(f"the mlflow store cannot be opened: {e}") from None
    except Exception as e:
        where = f"the mlflow store {db}" if db else f"the mlflow tracking server {uri}"
        fix = f" ({common.REBUILD})" if db is not None and db.exists() else ""
        if db is None and common.INVALID_HOST in str(e):
            raise StoreError(common.host_refused(uri)) from None
        text = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
        raise StoreError(f"{where} cannot be opened: {why}{fix}") from None


def read_mounts() -> str:
    """The mount table (empty if it cannot be read), at most MAX_MOUNTS_BYTES."""
    try:
        with open(MOUNTS, "rb") as f:
            return f.read(MAX_MOUNTS_BYTES).decode(errors="replace")
    except OSError:
        return ""


def check_shared(client, db: Path) -> str | None:
    """Record this host on the store; warn (one line, returned) if the store is shared beyond one machine."""
    hosts: set[str] = set()
    with suppress(Exception):
        exp = client.get_experiment("0")  # Default: every mlflow store has it
        hosts = {h for h in (exp.tags or {}).get(HOSTS_TAG, "").split(",") if h}
        me = socket.gethostname()
        if me not in hosts and len(hosts) < MAX_HOSTS:
            hosts.add(me)
            client.set_experiment_tag("0", HOSTS_TAG, ",".join(sorted(hosts)))
    where, best, kind = Path(os.path.realpath(db.parent)), -1, None
    for line in read_mounts().splitlines():  # its filesystem: the longest mount point above it
        fields = line.split()
        point = Path(fields[1].replace("\\040", " ")) if len(fields) >= 3 else None
        above = point is not None and (point == where or point in where.parents)
        if above and len(str(point)) > best:
            best, kind = len(str(point)), fields[2]
    if kind in NETWORK_FS:
        problem = f"the mlflow store {db} is on a network filesystem ({kind})"
    elif len(hosts) > 1:
        problem = f"the mlflow store {db} is opened by jobs on {len(hosts)} hosts ({', '.join(sorted(hosts)[:5])})"
    else:
        return None
    text = f"{problem}: sqlite's locks are not to be trusted there; for a team or a cluster, {TEAM_SETUP}"
    log.warning(text)
    return text


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The experiment's id: created (artifacts under `artifact_root`) or restored, and marked machine learning."""
    tag, kind = common.EXPERIMENT_KIND_TAG, common.EXPERIMENT_KIND
    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = None
        if root := common.artifact_root(client.tracking_uri, artifact_root):
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "experiment"
            location = root.rstrip("/") + "/" + safe
        try:
            return client.create_experiment(name, artifact_location=location, tags={tag: kind})
        except MlflowException:  # created by another process meanwhile
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if tag not in (exp.tags or {}):  # made before this mark existed, or by another tool
        client.set_experiment_tag(exp.experiment_id, tag, kind)
    return exp.experiment_id


def all_experiment_ids(client: MlflowClient) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(ViewType.ACTIVE_ONLY, 1000, page_token=token)
        ids += [e.experiment_id for e in page]
        if not (token := page.token):
            return ids


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _first(client: MlflowClient, ids: list[str], where: str, order: str):
    """The first run found by `where` in these experiments (searched 100 at a time), or None."""
    for i in range(0, len(ids), 100):
        if found := client.search_runs(ids[i : i + 100], where, max_results=1, order_by=[order]):
            return found[0]
    return None


def find_run(client: MlflowClient, run_dir: str, uri: str = "", run_uris: list | tuple = ()):
    """The run indexing `run_dir`: one run_uris name in `uri`'s store if tagged so, else the newest tagged, or None."""
    for base, _, rid in map(common.parse_run_uri, dict.fromkeys(run_uris)):
        if rid and base in (None, uri):  # a run of another store: never
            with suppress(MlflowException):
                run = client.get_run(rid)
                if run.info.lifecycle_stage == "active" and run.data.tags.get("run_dir") == run_dir:
                    return run
    where = f"tags.run_dir = {_quote(run_dir)}"
    return _first(client, all_experiment_ids(client), where, "attributes.start_time DESC")


def find_parent(client: MlflowClient, sweep_id: str, experiment_id: str | None = None):
    """The parent run of the sweep with this id (the first made, if several), or None."""
    ids = [experiment_id] if experiment_id else all_experiment_ids(client)
    where = f"tags.`sweep.id` = {_quote(sweep_id)} and tags.sweep = 'parent'"
    return _first(client, ids, where, "attributes.start_time ASC")


def create_run(client: MlflowClient, experiment_id: str, tags: dict, start_time=None):
    ms = int((start_time if start_time is not None else time.time()) * 1000)
    name = tags.get("mlflow.runName")
    return client.create_run(experiment_id, start_time=ms, tags=tags, run_name=name)


def sync_params(client: MlflowClient, run, params: dict[str, str]) -> int:
    """Log the params the run lacks (mlflow params never change): a changed one is a `params_changed.<key>` tag."""
    have = run.data.params
    new = [Param(k, v) for k, v in params.items() if k not in have]
    changed = {k: v for k, v in params.items() if have.get(k, v) != v}
    changed = {f"params_changed.{k}": common.tag_value(v) for k, v in changed.items()}
    added = _batches(client, run.info.run_id, "params", new, PARAMS_PER_BATCH)
    return added + sync_tags(client, run, changed)


def sync_tags(client: MlflowClient, run, tags: dict[str, str], derived: tuple = ()) -> int:
    """Set the tags that differ; delete the `derived` ones (keys, or `prefix.`es) `tags` no longer says. How many."""
    todo = [RunTag(k, v) for k, v in tags.items() if run.data.tags.get(k) != v]
    under = [d for d in derived if d.endswith(".")]
    gone = [k for k in run.data.tags if k not in tags]
    stale = [k for k in gone if k in derived or any(k.startswith(d) for d in under)]
    for key in stale:
        client.delete_tag(run.info.run_id, key)
    return _batches(client, run.info.run_id, "tags", todo, TAGS_PER_BATCH) + len(stale)


def logged_steps(client: MlflowClient, run_id: str, keys) -> set[tuple[str, int]]:
    """(key, step) of every metric point the run already has, for the given keys."""
    return {(key, m.step) for key in keys for m in client.get_metric_history(run_id, key)}


def log_points(client: MlflowClient, run_id: str, points: list, new_only: bool = False) -> int:
    """Log (key, value, timestamp ms, step) points; new_only: only those whose (key, step) the run lacks."""
    if new_only:
        logged = logged_steps(client, run_id, {p[0] for p in points})
        points = [p for p in points if (p[0], p[3]) not in logged]
    metrics = [Metric(k, v, ts, step) for k, v, ts, step in points]
    return _batches(client, run_id, "metrics", metrics, METRICS_PER_BATCH)


def _batches(client: MlflowClient, run_id: str, kind: str, items: list, size: int) -> int:
    for i in range(0, len(items), size):  # metrics, params or tags
        client.log_batch(run_id, **{kind: items[i : i + size]})  # type: ignore[arg-type]
    return len(items)


def artifact_repo(client: MlflowClient, run_id: str):
    """The run's artifact repository, resolved once (through the client, each call costs a get_run)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    where = client.get_run(run_id).info.artifact_uri
    return get_artifact_repository(where, tracking_uri=client._tracking_client.tracking_uri)


def log_file_as(repo, artifact_file: str, source: Path | bytes) -> None:
    """Log bytes or a file at the artifact path `artifact_file` (dir/name), whatever the local file is called."""
    artifact_dir, _, name = artifact_file.rpartition("/")
    with tempfile.TemporaryDirectory(prefix="pipeline-artifact-") as tmp:
        local = Path(tmp) / name
        if isinstance(source, bytes):
            local.write_bytes(source)
        else:  # the artifact store copies the target's bytes
            os.symlink(Path(source).resolve(), local)
        repo.log_artifact(str(local), artifact_dir or None)


def artifact_sizes(repo, path: str | None = None, depth: int = 3) -> dict[str, int]:
    """artifact path -> size of every file under `path` (a few levels deep)."""
    out: dict[str, int] = {}
    try:
        infos = repo.list_artifacts(path)
    except (MlflowException, OSError):
        return out
    for info in infos:
        if not info.is_dir:
            out[info.path] = info.file_size
        elif depth > 0:
            out.update(artifact_sizes(repo, info.path, depth - 1))
    return out


def artifact_bytes(repo, path: str, limit: int = MAX_ARTIFACT) -> bytes | None:
    """One logged artifact's content (None if absent or over `limit`): read in place if local, else downloaded."""
    root = getattr(repo, "artifact_dir", None)  # LocalArtifactRepository
    try:
        with tempfile.TemporaryDirectory(prefix="pipeline-artifact-") as tmp:
            local = Path(root) / path if root else Path(repo.download_artifacts(path, tmp))
            return local.read_bytes() if local.is_file() and local.stat().st_size <= limit else None
    except (MlflowException, OSError):
        return None
