"""The one place a run's objects are built (parts, facts, tracker); the model checked against the data first."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
from hydra.utils import get_class, instantiate

from pipeline.checkpoint import manifest as mf
from pipeline.config import identity, schemas
from pipeline.config.errors import ConfigError
from pipeline.config.schemas import as_written_now
from pipeline.data.base import DataSpec, inference_facts
from pipeline.data.iterator import DataIterator
from pipeline.files import patterns
from pipeline.run.plan import SETTINGS
from pipeline.run.sweep import SweepJob
from pipeline.run.tracker import Tracker
from pipeline.stages.base import StageStates
from pipeline.trainer.loop import kept, train_metric_names, val_metric_names
from pipeline.trainer.rng import Streams
from pipeline.trainer.state import TrainState


def _call(node: dict, **live):
    """Build a `_target_` node with live values (config/schemas.py LIVE) as arguments, never through the config."""
    kind = next(k for k, (need, may) in schemas.LIVE.items() if set(live) == {*need, *may})
    factory = instantiate(node, _partial_=True)
    if problem := schemas.live_problem(kind, node["_target_"], factory.func):
        raise ConfigError(problem)
    accepted = schemas.takes(factory.func)
    if accepted is not None:
        live = {k: v for k, v in live.items() if k in accepted}
        unknown = [k for k in node if not k.startswith("_") and k not in accepted]
        if accepted and unknown:
            # a schema-less option (your own model or data) with a key its class does not take: a typo
            takes = ", ".join(k for k in accepted if k not in live)
            said = f"takes no argument {unknown[0]!r} (its config has a key it does not know)"
            raise ConfigError(f"{node['_target_']} {said}; it takes: {takes}")
    return factory(**live)


def build_dataset(config: dict):
    node = dict(config["data"])
    if isinstance(node.get("path"), str):
        node["path"] = str(Path(node["path"]).expanduser().resolve())
    return _call(node, cache_dir=str(Path(config["paths"]["output_dir"]) / "data"))


def build_state(config: dict, spec: DataSpec, n_train: int, dataset=None) -> TrainState:
    """The stages, the streams, the iterator, then the model (its init stream), optimizer and scheduler."""
    trainer = config["trainer"]
    dtype = np.dtype(trainer["dtype"])
    stages = StageStates(build_stages(config))
    streams = Streams(trainer["seed"])
    offsets = getattr(dataset, "n_offsets", 0)  # every_offset: any window start of the train stream
    iterator = DataIterator(n_train, trainer["batch_size"], streams["data_order"], offsets)
    # updates in the run: max_steps (> 0), else every epoch's micro-batches in groups of trainer.accumulate
    epochs, accumulate = int(trainer["epochs"]), int(trainer["accumulate"])
    steps = int(trainer["max_steps"]) or epochs * iterator.batches_per_epoch // accumulate
    model = _call(config["model"], spec=spec, dtype=dtype.name, rng=streams["init"])
    optimizer = _call(config["optimizer"], params=model.params)
    scheduler = _call(config["scheduler"], optimizer=optimizer, run_total_steps=steps)
    objects = (model, optimizer, scheduler, iterator, streams, dataset, dtype)  # TrainState's order
    clip, shards = float(trainer["grad_clip"]), int(trainer["shards"])
    given = {k: trainer[k] for k in ("threads", "eval_batches", "eval_at_start")}
    return TrainState(*objects, steps, accumulate, clip, shards, **given, stages=stages)


def build_stages(config: dict) -> list:
    """Every node under `stages` but the settings (run/plan.SETTINGS), named by its key (its state's name)."""
    stages = []
    for key, node in (config.get("stages") or {}).items():
        if node is not None and key not in SETTINGS:
            stage = instantiate(as_written_now(node))
            stage.name = str(key)
            stages.append(stage)
    return sorted(stages, key=lambda s: s.order)


def build_tracker(config: dict, sweep: SweepJob | None = None) -> Tracker:
    """The `tracking` node's tracker (none: the protocol's no-op), told its sweep job if it takes `sweep`."""
    tracking = config.get("tracking")
    return Tracker() if tracking is None else _call(tracking, sweep=sweep)


@dataclass
class Job:
    config: dict
    state: TrainState
    sources: dict  # SOURCES keys -> sha256 of the file's bytes
    facts: dict  # the run-level manifest fields
    lineage: dict  # the history it starts (identity.Identity.lineage; a fork's names its origin)
    tracker: Tracker = field(default_factory=Tracker)  # with run_dir: given by run/job.build
    run_dir: Path | None = None

    @property
    def stages(self) -> list:
        return cast(StageStates, self.state.stages).stages

    @property
    def parts(self) -> dict:
        return self.state.parts()


def _class(config: dict, key: str) -> type:
    try:
        return get_class(config[key]["_target_"])
    except Exception as e:
        raise ConfigError(f"cannot import a _target_: {str(e).splitlines()[0]}") from None


KINDS = {"tokens": "token sequences", "rows": "rows of features"}


def check_pairing(config: dict) -> None:
    """A model that cannot train on the data is refused before the data is built (a corpus generated)."""
    model, data = _class(config, "model"), _class(config, "data")
    needs, kind = getattr(model, "needs", None), getattr(data, "kind", None)
    if needs and kind and needs != kind:
        said = f"model {model.__name__} trains on {KINDS.get(needs, needs)}"
        said += f", but data {data.__name__} gives {KINDS.get(kind, kind)}"
        pair = "model=minigpt with data=grammar or data=text, and model=mlp with data=regression"
        raise ConfigError(f"{said}: pair {pair}")


# The config keys check_monitors reads: a sweep that sweeps none of them has the same answer for every job.
MONITOR_KEYS = ("data", "trainer.grad_clip", "stages", "optimized_metric")


def metric_names(config: dict) -> list[str]:
    """Every metric the configured run measures (what a stage's `monitor` may name), from the data's class."""
    data = _class(config, "data")
    grad_clip = float(config["trainer"]["grad_clip"])
    return sorted({*train_metric_names(data, grad_clip), *val_metric_names(data)})


def check_monitors(config: dict) -> None:
    """ConfigError (one line, the closest names) for a `monitor`, `filename` field or `optimized_metric` not logged."""
    names = metric_names(config)
    stages = [(k, n) for k, n in (config.get("stages") or {}).items() if isinstance(n, dict)]
    monitors = [(key, node["monitor"]) for key, node in stages if "monitor" in node]
    wanted = [(f"stages.{key}.monitor={m}", m, names) for key, m in monitors]
    # a field is a metric by its name, or by Lightning's val_loss for val/loss
    for key, node in stages:
        if isinstance(pattern := node.get("filename"), str) and patterns.problem(pattern) is None:
            fields = patterns.metric_fields(pattern)
            fields = [f for f in fields if not set(patterns.spellings(f)) & set(names)]
            at = f"stages.{key}.filename={pattern!r}"
            wanted += [(f"{at}: field {{{f}}}", f, names) for f in fields]
    if (metric := config.get("optimized_metric")) is not None:
        wanted.append((f"optimized_metric={metric}", metric, [n for n in names if kept(n)]))
    errors = []
    for what, value, known in wanted:
        if value not in known:
            close = difflib.get_close_matches(str(value), known, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            why = "this run logs no such metric"
            if value in names:
                why = "logged, but not a metric whose last value the run keeps"
            errors.append(f"{what}: {why}; {hint}it can be one of: {', '.join(known)}")
    if errors:
        raise ConfigError("; ".join(errors))


def assemble(config: dict, ident: identity.Identity) -> Job:
    """A validated config's Job without a tracker or run directory; ValueError or OSError for refused values."""
    dataset = build_dataset(config)
    state = build_state(config, dataset.spec, dataset.n_train, dataset)
    spec = {**asdict(dataset.spec), "n_train": int(dataset.n_train)}
    facts = mf.run_facts(config, ident, dataset.manifest_hash, spec, inference_facts(dataset))
    facts["n_params"] = int(sum(p.size for p in state.model.params.values()))
    return Job(config, state, ident.sources, facts, ident.lineage)
