"""What the tracker, the agent, the index, reindex and register share; imports nothing heavy (no mlflow)."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.config.identity import experiment_name, is_machine_key
from pipeline.files import reading
from pipeline.files.jsonio import NON_FINITE, flatten

MAX_PARAM_VALUE = 6000  # mlflow's limit on a param value
MAX_TAG_VALUE = 8000
NON_METRIC_KEYS = ("step", "epoch", "time")
CURVES_ARTIFACT = "curves.png"
# Seconds a SLURM job's process waits at exit for the agent: SLURM ends the agent with the job's processes.
SLURM_WAIT = 60.0
SQLITE_HEADER = b"SQLite format 3\x00"
INVALID_HOST = "Invalid Host header"  # mlflow server's 403 to a host name it was not given with --allowed-hosts
REBUILD = "move it aside and rebuild it from the manifests: python -m pipeline.reindex --rebuild"

_RUN_ROUTE = re.compile(r"^/?experiments/([^/]+)/runs/([0-9a-fA-F]{32})/?$")


def run_uri(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A manifest's mlflow_run_uri: the store (`mlflow ui --backend-store-uri`'s), `#`, the UI's route to the run."""
    return f"{tracking_uri}#/experiments/{experiment_id}/runs/{run_id}"


def parse_run_uri(uri: str | None) -> tuple[str | None, str | None, str | None]:
    """(tracking_uri, experiment_id, run_id) of a run_uri, `runs:/<id>` or a bare id; Nones for what it lacks."""
    if not uri or not isinstance(uri, str):
        return None, None, None
    if uri.startswith("runs:/"):
        return None, None, uri.removeprefix("runs:/").split("/")[0] or None
    if re.fullmatch(r"[0-9a-fA-F]{32}", uri):
        return None, None, uri
    base, sep, fragment = uri.partition("#")
    if not sep:
        return None, None, None
    m = _RUN_ROUTE.match(fragment)
    return (base or None), (m.group(1) if m else None), (m.group(2) if m else None)


def normalize_tracking_uri(uri: str) -> str:
    """sqlite URIs with an absolute path, whatever the working directory; anything else as given."""
    uri, prefix = str(uri).strip(), "sqlite:///"
    path = uri.removeprefix(prefix)
    if uri.startswith(prefix) and not path.startswith("/") and path not in ("", ":memory:"):
        return prefix + str(Path(path).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    path = uri.removeprefix("sqlite:///")
    ok = uri.startswith("sqlite:///") and "?" not in uri and path not in ("", ":memory:")
    return Path(path) if ok else None


def store_problem(uri: str, timeout: float = 0.5) -> str | None:
    """What is plainly wrong with a store (not sqlite, unmakeable, a port refusing), found without mlflow, or None."""
    db = sqlite_path(uri)
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)  # the agent would make it too
            if db.exists():
                with reading.open_file(db, follow=True) as f:  # a FIFO, a device: refused
                    head = f.read(len(SQLITE_HEADER))
                if head and head != SQLITE_HEADER:
                    return f"the mlflow store {db} cannot be opened: it is not a sqlite database ({REBUILD})"
            if not os.access(db.parent, os.W_OK):
                return f"the mlflow store {db} cannot be written: {db.parent} is not writable"
        except OSError as e:
            return f"the mlflow store {db} cannot be opened: {e.strerror or e}"
        return None
    if (parts := urlsplit(uri)).scheme in ("http", "https") and parts.hostname:
        import urllib.error
        import urllib.request

        api = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1"
        try:  # any API path: the server checks the Host header before it routes
            urllib.request.urlopen(api, timeout=timeout).close()
        except urllib.error.HTTPError as e:
            with e:
                said = e.read(4096).decode(errors="replace") if e.code == 403 else ""
            return host_refused(uri) if INVALID_HOST in said else None  # else: the agent finds out
        except urllib.error.URLError as e:
            if isinstance(e.reason, (ConnectionRefusedError, socket.gaierror)):
                return f"the mlflow tracking server {uri} cannot be reached: {e.reason.strerror or e.reason}"
        except OSError:
            pass  # slow, not refused: the agent finds out
    return None


def host_refused(uri: str) -> str:
    """A server refusing the host name it is reached by, and the fix (mlflow >= 3.5 accepts only local ones)."""
    netloc = urlsplit(uri).netloc.rpartition("@")[2]
    fix = f"`mlflow server ... --allowed-hosts {netloc}` (docs/tracking.md: Team setup)"
    return f"the mlflow tracking server {uri} refuses the host name {netloc} (403: {INVALID_HOST}): start it with {fix}"


# Stores whose client writes the artifacts (the caller says where); any other is a server: it says.
_CLIENT_SIDE_STORES = ("sqlite", "postgresql", "mysql", "mssql", "file")


def artifact_root(uri: str, location: str | None = None) -> str | None:
    """Where the store at `uri` keeps this pipeline's artifacts: a server chooses (None), else an absolute URI."""
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9.-]*)(\+[a-zA-Z0-9.-]*)?:", str(uri))
    kind = scheme[1].lower() if scheme is not None else ""  # one letter: a Windows drive, local
    if str(uri).startswith("databricks") or (len(kind) > 1 and kind not in _CLIENT_SIDE_STORES):
        return None
    db = sqlite_path(str(uri))
    location = str(location or (db.parent / "mlartifacts" if db is not None else ""))
    # a local directory becomes an absolute file: URI; a URI (s3://, mlflow-artifacts:, file:) is kept
    if not location or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", location):
        return location or None
    return Path(location).resolve().as_uri()


def default_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve()}/mlflow.db"


def param_value(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return s if len(s) <= MAX_PARAM_VALUE else s[: MAX_PARAM_VALUE - 15] + "...[truncated]"


# The machine keys worth a `config.<key>` tag (what one filters on); the rest: .hydra/config.yaml.
MACHINE_TAGS = ("resume.source", "data.path", "trainer.threads", "trainer.max_time")
# mlflow 3's marking of an experiment's kind (its UI's selector): "Machine learning", runs, not GenAI traces
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


# The tags tags_of takes from the newest manifest that a later one may no longer say (a resume without the first
# process's trainer.max_time): deleted then, so that the live run holds what a rebuild from disk does.
DERIVED_RUN_TAGS = ("config.", "allowed_changes", "mlflow.source.git.commit")


def params_of(config: dict) -> dict[str, str]:
    """The flattened resolved config as mlflow params (dotted keys, values as text), machine keys left out."""
    return {k: param_value(v) for k, v in flatten(config).items() if not is_machine_key(k)}


def tag_value(v) -> str:
    return (v if isinstance(v, str) else json.dumps(v, sort_keys=True))[:MAX_TAG_VALUE]


def experiment_of(config: dict) -> str:
    """A config's tracking.experiment, else (tracked by none, indexed later) what tracking=mlflow would give it."""
    if tracked := (config.get("tracking") or {}).get("experiment"):
        return str(tracked)
    parts = ((config.get(g) or {}).get("_target_", "") for g in ("model", "data"))
    return experiment_name(str(config.get("name") or "default"), *parts)


FACT_TAGS: tuple[str, ...] = ("config_hash", "semantic_config_hash", "data_manifest_hash")
FACT_TAGS += ("git_sha", "git_dirty", "seed")


def tags_of(facts: dict, run_dir: str | Path, status=None, job=None) -> dict[str, str]:
    """The run-level facts as tags (what a person filters on): the manifest's, MACHINE_TAGS, resumes, sweep job."""
    config = facts.get("config") or {}
    flat = flatten(config)
    tags: dict = {k: facts.get(k) for k in FACT_TAGS} | {"model.parameters": facts.get("n_params")}
    tags |= {"run_dir": str(Path(run_dir).resolve()), "experiment": str(config.get("name", ""))}
    tags["mlflow.runName"] = (job or {}).get("name") or Path(run_dir).name
    tags |= {"mlflow.source.name": "pipeline", "mlflow.source.type": "LOCAL"}
    tags["allowed_changes"] = facts.get("allowed_changes") or None
    # `config.<key>` for the MACHINE_TAGS the config sets (null and `auto` say nothing): never a param
    tags |= {f"config.{k}": flat[k] for k in MACHINE_TAGS if flat.get(k) not in (None, "auto", "")}
    if facts.get("git_sha") not in (None, "unknown"):
        tags["mlflow.source.git.commit"] = facts["git_sha"]
    if resumes := (status or {}).get("resumes") or []:
        tags["resumes"] = len(resumes)
        tags.update({f"resume.{i}": r.get("step") for i, r in enumerate(resumes, start=1)})
    if job:
        tags.update(job_tags(job))
    return {k: tag_value(v) for k, v in tags.items() if v is not None}


def job_tags(job: dict) -> dict:
    """A sweep job's run's tags (its own run, or a repeat's child)."""
    said = {"sweep.id": job.get("sweep_id"), "sweep.job_num": job.get("num")}
    return {**said, "sweep.job_overrides": " ".join(job.get("overrides") or [])}


def metric_points(line: dict) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp ms, step) for every metric of one metrics.jsonl line."""
    ts, step = int(float(line.get("time", 0.0)) * 1000), int(line["step"])
    metrics = {k: v for k, v in line.items() if k not in NON_METRIC_KEYS and type(v) is not bool}
    numbers = (k for k, v in metrics.items() if isinstance(v, (int, float)) or v in NON_FINITE)
    return [(k, float(NON_FINITE.get(metrics[k], metrics[k])), ts, step) for k in numbers]
