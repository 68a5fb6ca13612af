"""Everything a run's future depends on, as flat arrays and JSON, grouped by state machine."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from pipeline.model.base import state_dict as model_state


def snapshot(state) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, json) keyed '<state machine>/<name>'; the RNG streams' next draws are peeked, not consumed."""
    arrays: dict[str, np.ndarray] = {}
    for name, a in model_state(state.model).items():
        arrays[f"model/{name}"] = np.array(a, order="C", copy=True)  # a copy: the live array keeps training
    opt = state.optimizer.state_dict()
    for k, v in opt.items():
        if isinstance(v, np.ndarray):
            arrays[f"optimizer/{k}"] = np.array(v, order="C", copy=True)
    arrays["optimizer/t"] = np.array([opt["t"]], dtype=np.int64)
    arrays["optimizer/lr"] = np.array([opt["lr"]], dtype=np.float64)
    it = state.iterator.state_dict()
    arrays["data_iter/permutation"] = it["permutation"].copy()
    arrays["data_iter/position"] = np.array([it["epoch"], it["cursor"]], dtype=np.int64)
    sched = state.scheduler.state_dict()
    arrays["scheduler/last_epoch"] = np.array([sched["last_epoch"]], dtype=np.int64)
    arrays["scheduler/next_lr"] = np.array([state.optimizer.lr], dtype=np.float64)
    peek = state.streams.peek()
    for name, value in peek.items():
        arrays[f"rng/next.{name}"] = np.array([value], dtype=np.float64)
    arrays["eval/losses"] = np.array([state.model.evaluate(b) for b in state.dataset.val_batches(state.dtype)])
    meta = {"step": state.step, "rng_states": state.streams.state_dict(), "scheduler": sched,
            "cursor": it["cursor"], "n_train": state.iterator.n, "epoch": it["epoch"]}
    return arrays, meta


def write_summary(directory: Path, state, records: list[dict], restored: tuple | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    arrays, meta = snapshot(state)
    if records:
        arrays["records/loss"] = np.array([r["train/loss"] for r in records], dtype=np.float64)
        arrays["records/lr"] = np.array([r["lr"] for r in records], dtype=np.float64)
        arrays["records/ids"] = np.stack([np.asarray(r["ids"], dtype=np.int64) for r in records])
        arrays["records/step"] = np.array([r["step"] for r in records], dtype=np.int64)
    save_file(arrays, str(directory / "summary.safetensors"))
    (directory / "summary.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if restored is not None:
        save_file(restored[0], str(directory / "restored.safetensors"))
        (directory / "restored.json").write_text(json.dumps(restored[1], indent=2, sort_keys=True) + "\n")


def read_summary(directory: Path, name: str = "summary") -> tuple[dict[str, np.ndarray], dict]:
    return load_file(str(directory / f"{name}.safetensors")), json.loads((directory / f"{name}.json").read_text())
