"""manifest.json: the truth about a checkpoint and its run (fields: docs/checkpoints.md), built and checked here."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import subprocess
from functools import cache, partial
from importlib import metadata
from pathlib import Path

from pipeline.config.identity import Identity, config_hash, semantic_hash
from pipeline.files import jsonio

SCHEMA_VERSION = "2.1"
# 2.0: no data.json (the tools build its data to find its vocabulary)
READABLE = ("2.0", SCHEMA_VERSION)
# the run facts' entry the store writes as data.json, not into manifest.json
DATA_FACTS = "data_facts"
PACKAGES = ("pipeline", "numpy", "safetensors", "hydra-core", "omegaconf", "mlflow")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ManifestError(ValueError):
    """manifest.json contradicts itself or lacks a field (the message says which)."""


@cache
def git_info(root: str = str(PROJECT_ROOT)) -> dict:
    unknown = {"git_sha": "unknown", "git_dirty": None}
    if not (Path(root) / "pyproject.toml").is_file():
        # Installed from a wheel: `root` is the environment's lib/pythonX.Y, and any repository around it (a
        # virtualenv inside a project) is not this code's; `versions` names the pipeline release instead.
        return unknown
    try:
        git = partial(subprocess.run, capture_output=True, text=True, timeout=30)
        sha = git(["git", "-C", root, "rev-parse", "HEAD"])
        if sha.returncode != 0:
            return unknown
        dirty = git(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
        return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return unknown


@cache
def code_sha256(package: str = str(Path(__file__).resolve().parents[1])) -> str:
    """sha256 over the package's Python files (path and bytes, in order): which code trained a run, git or not."""
    h = hashlib.sha256()
    root = Path(package)
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def code_change(manifest: dict, facts: dict | None = None) -> str | None:
    """How the code a checkpoint was written by differs from `facts`' (this process's): None if the same or unknown."""
    facts = facts if facts is not None else {**git_info(), "code_sha256": code_sha256()}

    def name(f: dict) -> str:
        dirty = " with uncommitted changes" if f.get("git_dirty") else ""
        sha = f.get("code_sha256")
        code = f" (code sha256 {sha[:12]})" if isinstance(sha, str) else ""
        return f"commit {str(f.get('git_sha'))[:12]}{dirty}{code}"

    if isinstance(manifest.get("code_sha256"), str) and isinstance(facts.get("code_sha256"), str):
        same = manifest["code_sha256"] == facts["code_sha256"]
    else:  # a checkpoint from before code_sha256: two edits of one commit cannot be told apart
        sha = manifest.get("git_sha")
        if not sha or "unknown" in (sha, facts.get("git_sha")):
            return None
        same = (sha, manifest.get("git_dirty")) == (facts.get("git_sha"), facts.get("git_dirty"))
    return None if same else f"{name(manifest)}, now {name(facts)}"


@cache
def versions() -> dict:
    out: dict[str, str | None] = {"python": platform.python_version(), **dict.fromkeys(PACKAGES)}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


@cache
def hardware() -> dict:
    from threadpoolctl import threadpool_info

    cpu = ram_gb = None
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        models = (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
        cpu = next(models, None)
    with contextlib.suppress(OSError, IndexError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        ram_gb = round(kb / 2**20, 1)
    said = dict(library="internal_api", version="version", threads="num_threads")
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    blas = [{k: i.get(v) for k, v in said.items()} for i in infos]
    cpu = (platform.processor() or "unknown") if cpu is None else cpu
    return dict(cpu=cpu, cores=os.cpu_count(), ram_gb=ram_gb, machine=platform.machine(), blas=blas)


def run_facts(config: dict, ident: Identity, data_hash: str, spec: dict, data_facts: dict) -> dict:
    """The fields every checkpoint of a run carries, computed once; `data_facts` become each one's data.json."""
    hashes = dict(config_hash=ident.config_hash, semantic_config_hash=ident.semantic_hash)
    data = dict(data_manifest_hash=data_hash, data_spec=dict(spec), sources=dict(ident.sources))
    run = dict(config=config, seed=config["trainer"]["seed"], mlflow_run_uri=None)
    machine = dict(versions=versions(), hardware=hardware(), code_sha256=code_sha256())
    return {DATA_FACTS: data_facts, **hashes, **data, **run, **machine, **git_info()}


def build(facts: dict, *, step: int, epoch: int, metrics: dict, tags: list, lineage: dict) -> dict:
    """Every field but `files`, which the store adds once the files are written."""
    counts = {"schema_version": SCHEMA_VERSION, "step": int(step), "epoch": int(epoch)}
    return {**facts, **counts, "metrics": dict(metrics), "tags": sorted(tags), "lineage": lineage}


def _require(m: dict, key: str, kinds, what: str):
    v = m.get(key)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise ManifestError(f"'{key}' must be {what}, got {v!r:.80}")
    return v


def check(m) -> dict:
    """Every field present and of its type, and the hashes agreeing with the config they are taken over."""
    if not isinstance(m, dict):
        raise ManifestError("not a JSON object")
    version = m.get("schema_version")
    if version not in READABLE:
        readable = " and ".join(map(repr, READABLE))
        why = f"schema_version {version!r}: this pipeline reads schema_version {readable} only"
        raise ManifestError(f"{why} (a checkpoint of another version of the pipeline)")
    step = _require(m, "step", int, "a non-negative integer")
    if step < 0 or _require(m, "epoch", int, "a non-negative integer") < 0:
        raise ManifestError("'step' and 'epoch' must be non-negative")
    for k, v in _require(m, "metrics", dict, "an object").items():
        try:
            jsonio.number(v)
        except ValueError as e:  # a string other than NaN/Infinity, an integer no float holds, ...
            raise ManifestError(f"metric {k!r:.80}: {e}") from None
    if not all(isinstance(t, str) for t in _require(m, "tags", list, "a list of stage names")):
        raise ManifestError("'tags' must be a list of stage names")
    lineage = _require(m, "lineage", dict, "an object")
    if not (isinstance(lineage.get("id"), str) and SHA256.match(lineage["id"])):
        raise ManifestError("'lineage.id' must be a sha256 hex digest")
    config = _require(m, "config", dict, "an object")
    sources = _require(m, "sources", dict, "an object")
    if not all(isinstance(v, str) and SHA256.match(v) for v in sources.values()):
        raise ManifestError("'sources' must map config keys to sha256 hex digests")
    edited = "(the config was edited after saving)"
    if _require(m, "config_hash", str, "a sha256 hex digest") != config_hash(config):
        raise ManifestError(f"'config_hash' is not the sha256 of 'config' {edited}")
    semantic = _require(m, "semantic_config_hash", str, "a sha256 hex digest")
    if semantic != semantic_hash(config, sources):  # present and a string before it is computed
        raise ManifestError(f"'semantic_config_hash' does not match 'config' {edited}")
    _require(m, "data_manifest_hash", str, "a string")
    _require(m, "data_spec", dict, "an object")
    _require(m, "mlflow_run_uri", (str, type(None)), "a string or null")
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    if (seed := m.get("seed")) != (wanted := trainer.get("seed")):
        raise ManifestError(f"'seed' {seed!r} differs from config trainer.seed {wanted!r}")
    _require(m, "files", dict, "an object")
    return m
