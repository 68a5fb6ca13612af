"""What every dataset gives the trainer: a spec for building the model, batches by sample id, a hash."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class DataSpec:
    """Shapes a model needs from its data; a model reads only the fields it uses."""

    n_features: int = 0  # regression inputs
    n_targets: int = 0  # regression outputs
    vocab_size: int = 0  # token datasets
    block_size: int = 0  # token datasets: sequence length T


@dataclass
class Batch:
    ids: np.ndarray  # [B] int64, the sample ids consumed (compared by the verifier)
    x: np.ndarray  # [B, n_features] float, or [B, T] int64 tokens
    y: np.ndarray  # [B, n_targets] float, or [B, T] int64 next tokens
    extra: dict = field(default_factory=dict)


class Dataset(Protocol):
    kind: str  # "tokens" ([B, T] ids) or "rows" ([B, n_features] floats): models say what they need
    spec: DataSpec
    n_train: int  # number of training samples (an epoch's)
    manifest_hash: str  # sha256 identifying the exact data (data_manifest_hash)
    baselines: tuple[str, ...]  # baseline_metrics' keys, known before building (absent: none)

    def train_batch(self, ids: np.ndarray, dtype: np.dtype) -> Batch: ...
    def augment(self, batch: Batch, streams) -> Batch: ...  # training noise from the run's streams
    def val_batches(self, dtype: np.dtype) -> Iterator[Batch]: ...
    def baseline_metrics(self) -> dict[str, float]: ...


def inference_facts(dataset) -> dict:
    """Token data's {"vocab", "decode_join", "specials"} (else none): each checkpoint's data.json (no corpus needed)."""
    facts = getattr(dataset, "inference_facts", None)
    return facts() if facts is not None else {"vocab": None, "decode_join": None, "specials": {}}
