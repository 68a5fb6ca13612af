"""The only module that makes checkpoint directories appear: temp sibling, fsync, rename, fsync parent."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

TMP_PREFIX = ".tmp-"  # temporaries are hidden siblings; every reader ignores them


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> dict:
    """Write bytes and fsync them; returns the file's {"size", "sha256"}."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_json(path: Path, obj) -> dict:
    """Write obj as indented, key-sorted JSON and fsync it; returns the file's {"size", "sha256"}."""
    return write_synced(path, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n").encode())


def remove_temporaries(parent: Path) -> None:
    """Leftovers of saves that died before their rename; only a saver (holding the run lock) calls this."""
    if parent.is_dir():
        for p in parent.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def new_temporary(parent: Path, final_name: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{final_name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete temporary directory into place; the directory appears whole or not at all."""
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def discard(directory: Path) -> None:
    """Remove a directory by renaming it to a temporary first, so no reader sees it half-deleted."""
    doomed = directory.with_name(f"{TMP_PREFIX}discard-{directory.name}-{uuid.uuid4().hex[:8]}")
    os.rename(directory, doomed)
    fsync_dir(directory.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def replace_link(link: Path, target_name: str) -> None:
    """Point a relative symlink (e.g. checkpoints/best) at target_name atomically."""
    tmp = link.with_name(f"{TMP_PREFIX}{link.name}-{uuid.uuid4().hex[:8]}")
    os.symlink(target_name, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)
