"""Save, load, verify and apply a checkpoint of the five state machines."""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import chaos
from pipeline.checkpoint.atomic import discard, new_temporary, publish, remove_temporaries, write_json
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.tensors import DigestMismatch, read_tensors, write_tensors
from pipeline.model.base import load_state_dict as load_model_state
from pipeline.model.base import state_dict as model_state
from pipeline.rng import numpy_state_from_json, python_state_from_json

SCHEMA_VERSION = "1.0"
WEIGHTS, OPTIM, EXTRA, MANIFEST = "weights.safetensors", "optim.safetensors", "extra.json", "manifest.json"
STATE_MACHINES = ("model", "optimizer", "scheduler", "data_iter", "rng")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
CORRUPTED = "sha256 differs from manifest.json (corrupted)"


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
    optim_arrays["t"] = np.array([opt["t"]], dtype=np.int64)  # [1], as every checkpoint so far stores it
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
        # Each file is hashed from the bytes as they are written, and fsync'ed, before it is listed; the
        # two tensor files are written side by side, as sha256 of one stream is slower than the disk.
        with ThreadPoolExecutor(1, thread_name_prefix="save-weights") as pool:
            weights_entry = pool.submit(write_tensors, tmp / WEIGHTS, weights)
            optim_entry = write_tensors(tmp / OPTIM, optim_arrays, {"t": str(extra["optimizer"]["t"])})
            files = {WEIGHTS: weights_entry.result(), OPTIM: optim_entry}
        chaos.point("save", "after weights")
        chaos.point("save", "after optim")
        files[EXTRA] = write_json(tmp / EXTRA, extra)
        manifest = {**facts, "schema_version": SCHEMA_VERSION, "step": state.step, "epoch": state.epoch,
                    "metrics": dict(state.metrics), "files": files}
        chaos.point("save", "before manifest")
        write_json(tmp / MANIFEST, manifest)  # last: a directory with a manifest is complete
        chaos.point("save", "before rename")
        if directory.exists():
            # Same step saved again (e.g. a re-run): keep the old one only if it still verifies.
            try:
                kept = verify(directory)
                shutil.rmtree(tmp)
                return kept["files"][WEIGHTS]["sha256"]  # the hash of the checkpoint that is on disk
            except CheckpointError:
                discard(directory)  # renamed away first: never a half-deleted directory in plain sight
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
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(directory, MANIFEST, f"not valid JSON ({e.msg if hasattr(e, 'msg') else e})")
    if not isinstance(manifest, dict):
        raise CheckpointError(directory, MANIFEST, "not a JSON object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(directory, MANIFEST,
                              f"schema_version {manifest.get('schema_version')!r} is not {SCHEMA_VERSION!r}")
    return manifest


def check_listing(directory: Path, manifest: dict) -> dict[str, dict]:
    """Every file listed, present and of its listed size, and nothing unlisted; returns the listing.

    The sha256 of each file is checked by load() in the same pass that reads it.
    """
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckpointError(directory, MANIFEST, "has no 'files' table")
    for name, entry in listed.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(directory, MANIFEST, f"lists an invalid file name {name!r}")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and SHA256.match(entry["sha256"])):
            raise CheckpointError(directory, MANIFEST, f"entry for {name} needs an integer size and a sha256 hex digest")
    # Temporaries are ignored beside checkpoints, not inside one: a published directory holds only its files.
    present = {p.name for p in Path(directory).iterdir() if p.name != MANIFEST}
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
        if size != entry["size"]:
            raise CheckpointError(directory, name, f"size {size} bytes, manifest says {entry['size']}")
    return listed


def verify(directory: Path) -> dict:
    """Full verification without live objects; returns the manifest or raises CheckpointError."""
    return load(directory).manifest


def _read_tensors(directory: Path, name: str, entry: dict) -> dict[str, np.ndarray]:
    try:
        arrays, _ = read_tensors(directory / name, expected_sha256=entry["sha256"])
    except DigestMismatch:
        raise CheckpointError(directory, name, CORRUPTED) from None
    except (ValueError, OSError) as e:
        raise CheckpointError(directory, name, str(e)) from None
    return arrays


def load(directory: Path) -> Checkpoint:
    """Manifest first, then the listing and sizes, then each file read once and hashed as it is read."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, ".", "not a directory")
    manifest = read_manifest(directory)
    listed = check_listing(directory, manifest)
    blobs = {}
    for name, entry in sorted(listed.items()):
        if name not in (WEIGHTS, OPTIM):
            blobs[name] = (directory / name).read_bytes()
            if hashlib.sha256(blobs[name]).hexdigest() != entry["sha256"]:
                raise CheckpointError(directory, name, CORRUPTED)
    with ThreadPoolExecutor(1, thread_name_prefix="load-weights") as pool:  # side by side, as in save()
        weights_read = pool.submit(_read_tensors, directory, WEIGHTS, listed[WEIGHTS])
        try:
            optim_arrays = _read_tensors(directory, OPTIM, listed[OPTIM])
        finally:
            weights = weights_read.result()  # weights.safetensors' own error first, as the files are listed
    try:
        extra = json.loads(blobs[EXTRA])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(directory, EXTRA, f"not valid JSON ({e})")
    if not isinstance(extra, dict):
        raise CheckpointError(directory, EXTRA, "not a JSON object")
    for key in ("step", "epoch", "optimizer", "scheduler", "data_iter", "rng", "progress"):
        if key not in extra:
            raise CheckpointError(directory, EXTRA, f"missing key {key!r}")
    for key in ("step", "epoch"):
        if extra[key] != manifest.get(key):
            raise CheckpointError(directory, EXTRA, f"{key} {extra[key]} differs from manifest.json's {manifest.get(key)}")
    if not isinstance(extra["progress"], dict) or extra["progress"].get("step") != extra["step"]:
        raise CheckpointError(directory, EXTRA, "progress.step differs from step")
    t = optim_arrays.pop("t", None)
    if not isinstance(extra["optimizer"], dict) or t is None or t.shape != (1,) or t.dtype.kind not in "iu" \
            or int(t[0]) != extra["optimizer"].get("t"):
        raise CheckpointError(directory, OPTIM, "optimizer step count t is missing or differs from extra.json")
    if "lr" not in extra["optimizer"]:
        raise CheckpointError(directory, EXTRA, "optimizer.lr is missing")
    return Checkpoint(directory, manifest, weights, {**optim_arrays, "t": int(t[0]), "lr": extra["optimizer"]["lr"]},
                      extra)


def _tie_groups(arrays: dict[str, np.ndarray]) -> list[list[str]]:
    """Names that are one array object, for every object with more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, a in arrays.items():
        by_id.setdefault(id(a), []).append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


def _arrays_fit(live: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> str | None:
    missing, unexpected = sorted(set(live) - set(got)), sorted(set(got) - set(live))
    if missing or unexpected:
        parts = ([f"the checkpoint lacks {missing}"] if missing else []) + \
                ([f"the live run has no {unexpected}"] if unexpected else [])
        return "keys differ: " + "; ".join(parts)
    for name in sorted(live):
        a, p = got[name], live[name]
        if a.shape != p.shape or a.dtype != p.dtype:
            return f"{name} is {a.dtype}{list(a.shape)}, the live run has {p.dtype}{list(p.shape)}"
    return None


def _misfit(ckpt: Checkpoint, state, restore: tuple[str, ...]) -> tuple[str, str, str] | None:
    """(file, state machine, reason) for the first piece that would not fit the live objects, else None."""
    if "model" in restore:
        live = model_state(state.model)
        if reason := _arrays_fit(live, ckpt.weights):
            return WEIGHTS, "model", reason
        if _tie_groups(live) != _tie_groups(ckpt.weights):
            return WEIGHTS, "model", (f"tied names differ: the checkpoint ties {_tie_groups(ckpt.weights)}, "
                                      f"the live model {_tie_groups(live)}")
    if "optimizer" in restore:
        live = {k: v for k, v in state.optimizer.state_dict().items() if isinstance(v, np.ndarray)}
        got = {k: v for k, v in ckpt.optim.items() if k not in ("t", "lr")}
        if reason := _arrays_fit(live, got):
            return OPTIM, "optimizer", reason
    extra, section = ckpt.extra, "scheduler"
    try:
        if "scheduler" in restore and set(extra["scheduler"]) != set(state.scheduler.state_dict()):
            return EXTRA, "scheduler", f"keys {sorted(extra['scheduler'])}, expected {sorted(state.scheduler.state_dict())}"
        section = "data_iter"
        if "data_iter" in restore:
            d = extra["data_iter"]
            perm = np.asarray(d["permutation"])
            if perm.shape != (state.iterator.n,) or perm.dtype.kind not in "iu":
                return EXTRA, "data_iter", f"permutation of {perm.shape} {perm.dtype}, expected ({state.iterator.n},) integers"
            int(d["epoch"]), int(d["cursor"])
        section = "progress"
        int(extra["progress"]["step"]), dict(extra["progress"]["metrics"])
        if "rng" in restore:
            section = "rng"
            rng = extra["rng"]
            if set(rng) != set(state.streams.names()):
                return EXTRA, "rng", f"streams {sorted(rng)}, expected {sorted(state.streams.names())}"
            for name in state.streams.np:  # decoded onto scratch generators: the live ones stay untouched
                section = f"rng stream {name!r}"
                np.random.PCG64().state = numpy_state_from_json(rng[name])
            for name in state.streams.py:
                section = f"rng stream {name!r}"
                random.Random().setstate(python_state_from_json(rng[name]))
    except (KeyError, ValueError, TypeError, IndexError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        return EXTRA, section, what
    return None


def apply(ckpt: Checkpoint, state, restore: tuple[str, ...] = STATE_MACHINES) -> None:
    """Restore the live objects in place, in seed 003's order; RNG streams last.

    Everything is checked against the live objects first, so a checkpoint that does not fit raises
    CheckpointError and leaves them untouched. `restore` names the state machines to restore (the
    verifier's negative control leaves out "rng").
    """
    if misfit := _misfit(ckpt, state, restore):
        file, what, reason = misfit
        raise CheckpointError(ckpt.directory, file, f"{what} does not fit the live run: {reason}")

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
