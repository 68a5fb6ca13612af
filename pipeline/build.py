"""The door: turns the composed config into live, typed objects; nothing past here sees a DictConfig."""
from __future__ import annotations

import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.data.iterator import DataIterator
from pipeline.rng import Streams
from pipeline.trainer.state import RunState


def plain(node) -> dict:
    """A resolved plain-dict copy of a config node (enums as their names)."""
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else node


def total_steps(trainer: dict, batches_per_epoch: int) -> int:
    return int(trainer["max_steps"]) if trainer["max_steps"] > 0 else int(trainer["epochs"]) * batches_per_epoch


def build_state(cfg) -> RunState:
    """Objects first, in seed 003's order: streams, data, model, optimizer, scheduler, iterator."""
    trainer = plain(cfg.trainer)
    dtype = np.dtype(trainer["dtype"])
    streams = Streams(trainer["seed"])
    dataset = instantiate(plain(cfg.data))
    # Live objects go in through partials: instantiate() would wrap dicts and dataclasses in DictConfigs.
    model = instantiate(plain(cfg.model), _partial_=True)(spec=dataset.spec, dtype=dtype.name, rng=streams["init"])
    optimizer = instantiate(plain(cfg.optimizer), _partial_=True)(params=model.params)
    iterator = DataIterator(dataset.n_train, trainer["batch_size"], streams["data_order"])
    steps = total_steps(trainer, iterator.batches_per_epoch)
    scheduler = instantiate(plain(cfg.scheduler), _partial_=True)(optimizer=optimizer, run_total_steps=steps)
    return RunState(model=model, optimizer=optimizer, scheduler=scheduler, iterator=iterator, streams=streams,
                    dataset=dataset, dtype=dtype, total_steps=steps)
