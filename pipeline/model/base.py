"""The model protocol the trainer, optimizers and checkpoints rely on, and the state protocol models share."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import numpy as np

from pipeline.data.base import Batch


class Model(Protocol):
    params: dict[str, np.ndarray]  # unique trainable arrays by canonical name, updated in place
    aliases: Mapping[str, str]  # tied name -> canonical name; both names are one ndarray object

    # Training forward (dropout from rng) and backward; grads keyed like params (tied grads summed).
    def loss_and_grads(self, batch: Batch, rng) -> tuple[float, dict[str, np.ndarray]]: ...
    def evaluate(self, batch: Batch) -> float: ...  # mean loss without dropout
    def state_dict(self) -> dict[str, np.ndarray]: ...
    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None: ...


def tie_groups(arrays: dict[str, np.ndarray]) -> list[list[str]]:
    """Names that are one array object, for every object with more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, a in arrays.items():
        by_id.setdefault(id(a), []).append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


class NamedParams:
    """State protocol for models whose state is `params` plus tied `aliases` (one object under two names)."""

    params: dict[str, np.ndarray]
    aliases: Mapping[str, str] = MappingProxyType({})  # none unless a model ties some

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every name, tied aliases included, mapped to the live array (no copies)."""
        return {**self.params, **{alias: self.params[t] for alias, t in self.aliases.items()}}

    def check_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        live, got = tie_groups(self.state_dict()), tie_groups(arrays)
        if live != got:
            why = f"the saved weights tie {got}, the live model {live}"
            raise ValueError(f"tied names differ: {why}")

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy values into the live arrays in place, so object identity (and tying) survives."""
        for name, p in self.params.items():
            np.copyto(p, arrays[name])


def summary(params: dict[str, np.ndarray], aliases: dict[str, str] | None = None):
    """Lightning's ModelSummary over named arrays: (rows, total); a row (group, shapes, params, note), the group a
    name up to its stack index (`transformer.h.0`) or its owner; a tied alias adds a "tied to" note, no parameters."""
    rows: dict[str, list] = {}
    for name, p in params.items():
        row = rows.setdefault(_group(name), [_group(name), [], 0, ""])
        row[1].append(tuple(p.shape))
        row[2] += int(p.size)
    for alias, target in sorted((aliases or {}).items()):
        rows.setdefault(_group(alias), [_group(alias), [], 0, ""])[3] = f"{alias} tied to {target}"
    unique = {id(p): p for p in params.values()}.values()
    return [tuple(row) for row in rows.values()], sum(int(p.size) for p in unique)


def _group(name: str) -> str:
    parts = name.split(".")
    i = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), len(parts) - 2)
    return ".".join(parts[: i + 1]) or name
