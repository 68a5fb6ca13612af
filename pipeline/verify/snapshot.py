"""Everything a run's future depends on, as flat arrays and JSON, grouped by state machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from pipeline.files import jsonio
from pipeline.files.limits import MAX_SUMMARY
from pipeline.stateful import PARTS, capture, copy_tree, flat, merge, split

# The protocol's workers step the state machines without the stages' decisions (chaos mode proves those).
MACHINES = tuple(p for p in PARTS if p != "stages")
RECORDED = {"train/loss": "f8", "lr": "f8", "ids": "i8", "step": "i8"}  # records/<name>: its dtype


def snapshot(state) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, json) keyed '<state machine>/<path>': state, next lr, data position, next draws, eval losses."""
    tree = copy_tree(capture(state.parts(), MACHINES))
    arrays: dict[str, np.ndarray] = {}
    for path, v in flat(tree).items():
        if isinstance(v, np.ndarray):
            arrays[path] = np.ascontiguousarray(v)
        elif isinstance(v, int) and not isinstance(v, bool) and not path.startswith("rng/"):
            arrays[path] = np.array([v], dtype=np.int64)
        elif isinstance(v, float):
            arrays[path] = np.array([v], dtype=np.float64)
    it = state.iterator
    arrays["data_iter/position"] = np.array([it.epoch, it.cursor], dtype=np.int64)
    arrays["scheduler/next_lr"] = np.array([state.optimizer.lr], dtype=np.float64)
    arrays |= {f"rng/next.{n}": np.array([v], "f8") for n, v in state.streams.peek().items()}
    val = state.dataset.val_batches(state.dtype)
    arrays["eval/losses"] = np.array([state.model.evaluate(b) for b in val])
    meta = {"step": state.step, "rng_states": tree["rng"], "scheduler": tree["scheduler"]}
    return arrays, {**meta, "cursor": it.cursor, "n_train": it.n, "epoch": it.epoch}


def _save(directory: Path, name: str, arrays: dict, meta: dict) -> None:
    save_file(arrays, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_bytes(jsonio.dumps(meta))


def write_summary(directory: Path, state, records: list[dict], restored=None) -> None:
    """summary (and restored, its snapshot at the cut) for the verdict; state, every part's whole tree."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays, meta = snapshot(state)
    for key, dtype in RECORDED.items() if records else ():
        arrays[f"records/{key.removeprefix('train/')}"] = np.array([r[key] for r in records], dtype)
    _save(directory, "summary", arrays, meta)
    if restored is not None:
        _save(directory, "restored", *restored)
    _save(directory, "state", *split(copy_tree(capture(state.parts()))))


def read_summary(directory: Path, name: str = "summary") -> tuple[dict[str, np.ndarray], dict]:
    arrays = load_file(str(directory / f"{name}.safetensors"))
    return arrays, jsonio.read(directory / f"{name}.json", MAX_SUMMARY)


def read_state(directory: Path) -> dict:
    return merge(*read_summary(directory, "state"))
