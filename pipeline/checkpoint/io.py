"""Save, load, verify and apply a checkpoint of the five state machines."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import chaos
from pipeline.checkpoint.atomic import (TMP_PREFIX, fsync_file, new_temporary, publish, remove_temporaries,
                                        sha256_file, write_json)
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.tensors import read_tensors, write_tensors
from pipeline.model.base import load_state_dict as load_model_state
from pipeline.model.base import state_dict as model_state

SCHEMA_VERSION = "1.0"
WEIGHTS, OPTIM, EXTRA, MANIFEST = "weights.safetensors", "optim.safetensors", "extra.json", "manifest.json"
STATE_MACHINES = ("model", "optimizer", "scheduler", "data_iter", "rng")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    directory: Path
    manifest: dict
    weights: dict[str, np.ndarray]  # tied names resolved to one array object
    optim: dict  # optimizer state: arrays, t, lr
    extra: dict  # scheduler, data_iter, rng, progress, callbacks

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def capture(state, callbacks_state: dict | None = None) -> tuple[dict, dict, dict]:
    """The live state as (weights, optimizer arrays, JSON extra); arrays are the live objects, not copies."""
    opt = state.optimizer.state_dict()
    optim_arrays = {k: v for k, v in opt.items() if isinstance(v, np.ndarray)}
    optim_arrays["t"] = np.array([opt["t"]], dtype=np.int64)  # [1]: 0-d arrays come back as [1] via pread
    it = state.iterator.state_dict()
    extra = {
        "step": state.step,
        "epoch": state.epoch,
        "optimizer": {"lr": opt["lr"], "t": opt["t"]},
        "scheduler": state.scheduler.state_dict(),
        "data_iter": {"epoch": it["epoch"], "cursor": it["cursor"], "permutation": it["permutation"].tolist()},
        "rng": state.streams.state_dict(),
        "progress": state.progress_dict(),
        "callbacks": callbacks_state or {},
    }
    return model_state(state.model), optim_arrays, extra


def save(state, directory: Path, facts: dict, callbacks_state: dict | None = None) -> str:
    """Write a checkpoint of `state` to `directory` atomically; returns sha256 of weights.safetensors.

    `facts` are the run-level manifest fields (config, hashes, versions, hardware, ...).
    """
    directory = Path(directory)
    remove_temporaries(directory.parent)
    weights, optim_arrays, extra = capture(state, callbacks_state)
    tmp = new_temporary(directory.parent, directory.name)
    try:
        write_tensors(tmp / WEIGHTS, weights)
        chaos.point("save", "after weights")
        write_tensors(tmp / OPTIM, optim_arrays, {"t": str(extra["optimizer"]["t"])})
        chaos.point("save", "after optim")
        write_json(tmp / EXTRA, extra)
        files = {}
        for name in (WEIGHTS, OPTIM, EXTRA):
            fsync_file(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        manifest = {**facts, "schema_version": SCHEMA_VERSION, "step": state.step, "epoch": state.epoch,
                    "metrics": dict(state.metrics), "files": files}
        chaos.point("save", "before manifest")
        write_json(tmp / MANIFEST, manifest)  # last: a directory with a manifest is complete
        chaos.point("save", "before rename")
        if directory.exists():
            # Same step saved again (e.g. a re-run): keep the old one only if it still verifies.
            try:
                verify(directory)
                shutil.rmtree(tmp)
                return files[WEIGHTS]["sha256"]
            except CheckpointError:
                shutil.rmtree(directory)
        publish(tmp, directory)
        chaos.point("save", "after rename")
    except BaseException:
        # A signal or an error mid-save: the half-made temporary is removed now or by the next save.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files[WEIGHTS]["sha256"]


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(directory, MANIFEST, "missing (an incomplete or foreign directory)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(directory, MANIFEST, f"not valid JSON ({e.msg if hasattr(e, 'msg') else e})")
    if not isinstance(manifest, dict):
        raise CheckpointError(directory, MANIFEST, "not a JSON object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(directory, MANIFEST,
                              f"schema_version {manifest.get('schema_version')!r} is not {SCHEMA_VERSION!r}")
    return manifest


def verify_files(directory: Path, manifest: dict) -> None:
    """Every file listed with its size and sha256, and nothing unlisted."""
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckpointError(directory, MANIFEST, "has no 'files' table")
    present = {p.name for p in Path(directory).iterdir() if p.name != MANIFEST and not p.name.startswith(TMP_PREFIX)}
    for name in sorted(present - set(listed)):
        raise CheckpointError(directory, name, "present but not listed in manifest.json")
    for name in (WEIGHTS, OPTIM, EXTRA):
        if name not in listed:
            raise CheckpointError(directory, MANIFEST, f"does not list {name}")
    for name, entry in sorted(listed.items()):
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(directory, name, "listed in manifest.json but missing")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(directory, name, f"size {size} bytes, manifest says {entry.get('size')}")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(directory, name, "sha256 differs from manifest.json (corrupted)")


def verify(directory: Path) -> dict:
    """Full verification without live objects; returns the manifest or raises CheckpointError."""
    return load(directory).manifest


def load(directory: Path) -> Checkpoint:
    """Manifest first, then sizes and hashes, then contents; never fills a missing piece in."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, ".", "not a directory")
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    try:
        weights, _ = read_tensors(directory / WEIGHTS)
    except ValueError as e:
        raise CheckpointError(directory, WEIGHTS, str(e))
    try:
        optim_arrays, _ = read_tensors(directory / OPTIM)
    except ValueError as e:
        raise CheckpointError(directory, OPTIM, str(e))
    try:
        extra = json.loads((directory / EXTRA).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(directory, EXTRA, f"not valid JSON ({e})")
    for key in ("step", "epoch", "optimizer", "scheduler", "data_iter", "rng", "progress"):
        if key not in extra:
            raise CheckpointError(directory, EXTRA, f"missing key {key!r}")
    if extra["step"] != manifest.get("step"):
        raise CheckpointError(directory, EXTRA, f"step {extra['step']} differs from manifest.json's {manifest.get('step')}")
    if "t" not in optim_arrays or optim_arrays["t"].shape != (1,) or int(optim_arrays["t"][0]) != extra["optimizer"]["t"]:
        raise CheckpointError(directory, OPTIM, "optimizer step count t is missing or differs from extra.json")
    t = int(optim_arrays.pop("t")[0])
    return Checkpoint(directory, manifest, weights, {**optim_arrays, "t": t, "lr": extra["optimizer"]["lr"]}, extra)


def apply(ckpt: Checkpoint, state, restore: tuple[str, ...] = STATE_MACHINES) -> None:
    """Restore the live objects in place, in seed 003's order; RNG streams last.

    `restore` names the state machines to restore (the verifier's negative control leaves out "rng").
    """
    def guarded(file: str, what: str, fn):
        try:
            fn()
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(ckpt.directory, file, f"{what} does not fit the live run: {e}")

    if "model" in restore:
        guarded(WEIGHTS, "model", lambda: load_model_state(state.model, ckpt.weights))
    if "scheduler" in restore:  # before the optimizer, so it cannot overwrite the restored lr
        guarded(EXTRA, "scheduler", lambda: state.scheduler.load_state_dict(ckpt.extra["scheduler"]))
    if "optimizer" in restore:
        guarded(OPTIM, "optimizer", lambda: state.optimizer.load_state_dict(ckpt.optim))
    if "data_iter" in restore:
        d = ckpt.extra["data_iter"]
        guarded(EXTRA, "data_iter", lambda: state.iterator.load_state_dict(
            {"epoch": d["epoch"], "cursor": d["cursor"], "permutation": np.asarray(d["permutation"], dtype=np.int64)}))
    guarded(EXTRA, "progress", lambda: state.load_progress(ckpt.extra["progress"]))
    if "rng" in restore:
        guarded(EXTRA, "rng", lambda: state.streams.load_state_dict(ckpt.extra["rng"]))
