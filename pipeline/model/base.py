"""The model protocol the trainer, optimizers and checkpoints rely on."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from pipeline.data.base import Batch


class Model(Protocol):
    params: dict[str, np.ndarray]  # unique trainable arrays by canonical name, updated in place
    aliases: dict[str, str]  # tied name -> canonical name; both names are one ndarray object

    def loss_and_grads(self, batch: Batch, rng: np.random.Generator | None) -> tuple[float, dict[str, np.ndarray]]:
        """Training forward (dropout from rng) and backward; grads keyed like params (tied grads summed)."""
        ...

    def evaluate(self, batch: Batch) -> float:
        """Mean loss without dropout."""
        ...


def state_dict(model) -> dict[str, np.ndarray]:
    """Every name, tied aliases included, mapped to the live array (no copies)."""
    out = dict(model.params)
    for alias, target in model.aliases.items():
        out[alias] = model.params[target]
    return out


def load_state_dict(model, arrays: dict[str, np.ndarray]) -> None:
    """Copy values into the live arrays in place, so object identity (and tying) survives."""
    expected = set(state_dict(model))
    if set(arrays) != expected:
        diff = sorted(set(arrays) ^ expected)
        raise KeyError(f"model state keys differ: {diff}")
    for name, p in model.params.items():
        a = arrays[name]
        if a.shape != p.shape or a.dtype != p.dtype:
            raise ValueError(f"{name}: got {a.dtype}{list(a.shape)}, expected {p.dtype}{list(p.shape)}")
        np.copyto(p, a)
