"""Facts about the run for the manifest: config hash, git sha, library versions, hardware."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGES = ("numpy", "safetensors", "hydra-core", "omegaconf", "mlflow")


def canonical_json(obj) -> bytes:
    """The bytes every hash in this project is taken over: sorted keys, no spaces, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def config_hash(config: dict) -> str:
    return hashlib.sha256(canonical_json(config)).hexdigest()


@lru_cache(maxsize=None)
def git_info(root: str) -> dict:
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return {"git_sha": "unknown", "git_dirty": None}
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown", "git_dirty": None}


@lru_cache(maxsize=None)
def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gb() -> float | None:
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        return round(kb / 2**20, 1)
    except (OSError, IndexError, ValueError):
        return None


@lru_cache(maxsize=None)
def hardware() -> dict:
    from threadpoolctl import threadpool_info

    blas = [{"library": i.get("internal_api"), "version": i.get("version"), "threads": i.get("num_threads")}
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "ram_gb": _ram_gb(), "machine": platform.machine(),
            "blas": blas}
