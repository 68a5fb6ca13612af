"""Typed schemas for every config node (types only: values live in conf/), SCHEMAS by `_target_`, `validate`."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Any

from omegaconf import MISSING

from pipeline.config import checks
from pipeline.config.errors import ConfigError
from pipeline.files import names, patterns
from pipeline.files.limits import MAX_TEXT_FILE

_BUILDING: dict[str, type] = {}  # `_target_` -> schema (@builds); frozen as SCHEMAS below


def builds(target: str, stored_as: str | None = None) -> Callable[[type], type]:
    """A dataclass schema for nodes whose `_target_` is `target` (in Hydra's ConfigStore as schema/<stored_as>)."""

    def add(schema: Any) -> Any:  # a class, made a dataclass carrying where Hydra stores it
        schema.stored_as = stored_as  # unannotated: no field (dataclass() works in place)
        _BUILDING[target] = dataclass(schema)  # noqa: F821 - deleted once frozen: a later @builds fails
        return schema

    return add


_NONE = object()


def _f(check: Callable | None = None, absent=_NONE):
    """A field; `absent`: what a config written without the key (or with null, before it could not be) means."""
    meta = ({"check": check} if check else {}) | ({} if absent is _NONE else {"absent": absent})
    return field(default=MISSING, metadata=meta)


Dtype = Enum("Dtype", {"float32": "float32", "float64": "float64"})
Activation = Enum("Activation", {"tanh": "tanh", "relu": "relu"})
DecayOn = Enum("DecayOn", {"all": "all", "matrices": "matrices"})
Gelu = Enum("Gelu", {"tanh": "tanh", "erf": "erf"})
Mode = Enum("Mode", {"min": "min", "max": "max"})
NonFinite = Enum("NonFinite", {"stop": "stop", "continue": "continue"})
KillMode = Enum("KillMode", {"none": "none", "random": "random"})


@dataclass
class Node:
    _target_: str = _f()


@dataclass
class PathsConf:
    output_dir: str = _f()
    runs_dir: str = _f()


@dataclass
class TrainerConf:
    seed: int = _f(checks.at_least(0))
    max_steps: int = _f(checks.at_least(0))  # > 0 wins over epochs
    epochs: int = _f(checks.at_least(0))
    batch_size: int = _f(checks.at_least(1))
    dtype: Dtype = _f()
    eval_every: int = _f(checks.at_least(0))
    eval_batches: int | None = _f(checks.at_least(1, null=True), absent=None)
    eval_at_start: bool = _f(absent=False)  # an evaluation before the first update
    log_every: int = _f(checks.at_least(0))
    progress_bar: bool | None = _f()
    on_nonfinite: NonFinite = _f()
    max_time: str | None = _f(checks.duration_or_null)
    accumulate: int = _f(checks.at_least(1))  # micro-batches (of batch_size) per update
    grad_clip: float = _f(checks.at_least(0))  # the largest global L2 norm of a gradient; 0: none
    shards: int = _f(checks.at_least(1))
    threads: int | None = _f(checks.at_least(1, null=True))
    profile: bool = _f(absent=False)

    @staticmethod
    def cross(c: dict) -> list[str]:
        why = "trainer.max_steps=0 and trainer.epochs=0: give one of them > 0 (the run would train nothing)"
        return [why] if c["max_steps"] == 0 and c["epochs"] == 0 else []


@builds("pipeline.model.mlp.MLP", "model/mlp")
class MLPConf(Node):
    hidden: list[int] = _f(checks.widths)
    activation: Activation = _f()
    dropout: float = _f(checks.fraction)


@builds("pipeline.model.minigpt.MiniGPT", "model/minigpt")
class MiniGPTConf(Node):
    n_layer: int = _f(checks.at_least(1))
    n_head: int = _f(checks.at_least(1))
    n_embd: int = _f(checks.at_least(1))
    block_size: int | None = _f()  # null: the data's sequence length
    dropout: float = _f(checks.fraction)
    attn_dropout: float | None = _f()  # null: dropout's
    init_std: float = _f(checks.above(0))
    bias: bool = _f(absent=True)
    gelu: Gelu = _f(absent="tanh")

    @staticmethod
    def cross(c: dict) -> list[str]:
        out = []
        if c["n_embd"] % c["n_head"]:
            out.append(f"model.n_embd={c['n_embd']} is not divisible by model.n_head={c['n_head']}")
        if c["attn_dropout"] is not None and checks.fraction(c["attn_dropout"]):
            out.append(f"model.attn_dropout={c['attn_dropout']}: must be in [0, 1)")
        if c["block_size"] is not None and c["block_size"] < 1:
            out.append(f"model.block_size={c['block_size']}: must be >= 1 (or null: the data's)")
        return out


@builds("pipeline.optimizer.sgd.SGD", "optimizer/sgd")
class SGDConf(Node):
    lr: float = _f(checks.above(0))
    momentum: float = _f(checks.at_least(0))
    dampening: float = _f(checks.at_least(0))
    nesterov: bool = _f()
    weight_decay: float = _f(checks.at_least(0))


@builds("pipeline.optimizer.adam.Adam", "optimizer/adam")
class AdamConf(Node):
    lr: float = _f(checks.above(0))
    betas: list[float] = _f(checks.probability_list)
    eps: float = _f(checks.above(0))
    weight_decay: float = _f(checks.at_least(0))
    weight_decay_on: DecayOn = _f(absent="all")


@builds("pipeline.optimizer.adam.AdamW", "optimizer/adamw")
class AdamWConf(AdamConf):
    pass


@builds("pipeline.scheduler.constant.Constant", "scheduler/constant")
class ConstantConf(Node):
    pass


@builds("pipeline.scheduler.step.StepLR", "scheduler/step")
class StepConf(Node):
    step_size: int = _f(checks.at_least(1))
    gamma: float = _f(checks.above(0))


@builds("pipeline.scheduler.cosine.WarmupCosine", "scheduler/cosine")
class CosineConf(Node):
    total_steps: int | None = _f()  # None: the run's total number of updates
    warmup_steps: int = _f(checks.at_least(0))
    warmup_offset: int = _f(checks.at_least(0), absent=0)
    min_lr_ratio: float = _f(checks.at_least(0))
    num_cycles: float = _f(checks.above(0))


@builds("pipeline.data.regression.Regression", "data/regression")
class RegressionConf(Node):
    n_rows: int = _f(checks.at_least(2))
    seed: int = _f(checks.at_least(0))
    noise: float = _f(checks.at_least(0))
    input_gain: float = _f(checks.fraction)
    input_noise: float = _f(checks.at_least(0))


@dataclass
class CorpusConf(Node):
    """What every token corpus on disk shares (written once under <output_dir>/data/)."""

    val_fraction: float = _f(checks.open_fraction)
    block_size: int = _f(checks.at_least(1))
    ngram_order: int = _f(checks.at_least(1))
    val_batch_size: int = _f(checks.at_least(1))


@builds("pipeline.data.grammar.GrammarCorpus", "data/grammar")
class GrammarConf(CorpusConf):
    seed: int = _f(checks.at_least(0))
    n_sentences: int = _f(checks.at_least(1))


@builds("pipeline.data.text.TextCorpus", "data/text")
class TextConf(CorpusConf):
    path: str = _f()
    # a config written while the key could be null (or before it) meant 32 MiB: conf/data/text.yaml's value
    max_bytes: int = _f(checks.at_least(1), absent=MAX_TEXT_FILE)
    every_offset: bool = _f(absent=False)  # a sample at any offset, not fixed windows


@builds("pipeline.stages.cadence.Cadence")
class CadenceConf(Node):
    every_epochs: int = _f(checks.at_least(0))
    every_steps: int = _f(checks.at_least(0))


@dataclass
class ResumeConf:
    source: str = _f()
    allow_changes: list[str] = _f()  # dotted keys allowed to differ from the checkpoint


@builds("pipeline.run.plan.Resume", "stage/resume")
class ResumeStageConf(ResumeConf, Node):
    order: int = _f()


@builds("pipeline.run.plan.Train", "stage/train")
class TrainStageConf(Node):
    eval_every: int = _f(checks.at_least(0))
    order: int = _f()


@builds("pipeline.stages.rotate.RotateLastN", "stage/rotate")
class RotateStageConf(Node):
    keep: int = _f(checks.at_least(1))
    cadence: Any = MISSING  # the `checkpoint` group's node
    order: int = _f()


@builds("pipeline.stages.best.BestVal", "stage/best_val")
class BestValStageConf(Node):
    monitor: str = _f()
    mode: Mode = _f()
    order: int = _f()
    keep: int = _f(checks.at_least(1), absent=1)
    filename: str | None = _f(lambda v: None if v is None else patterns.problem(v), absent=None)


@builds("pipeline.stages.early_stop.EarlyStop", "stage/early_stop")
class EarlyStopStageConf(Node):
    monitor: str = _f()
    mode: Mode = _f()
    patience: int = _f(checks.at_least(1))
    min_delta: float = _f(checks.at_least(0))
    order: int = _f()


@builds("pipeline.stages.final.Final", "stage/final")
class FinalStageConf(Node):
    order: int = _f()


@builds("pipeline.tracking.mlflow_tracker.MlflowTracker", "tracking/mlflow")
class MlflowTrackingConf(Node):
    uri: str = _f()
    artifact_location: str | None = _f()
    experiment: str = _f()
    wait: float = _f(checks.at_least(0))  # seconds a job waits on tracking in all


@builds("pipeline.run.tracker.Tracker", "tracking/none")
class NoTrackingConf(Node):
    pass


@dataclass
class VerifyConf:
    cut: int = _f(checks.at_least(1))  # updates before the interruption
    steps: int = _f(checks.at_least(2))  # updates in all
    atol: float = _f(checks.at_least(0))  # exact by default
    rtol: float = _f(checks.at_least(0))
    kill: KillMode = _f()
    trials: int = _f(checks.at_least(1))
    seed: int = _f(checks.at_least(0))  # chooses the chaos kill points
    max_reruns: int = _f(checks.at_least(1))


@dataclass
class Config:
    name: str = _f()  # the experiment's name: the first part of the run directory's name
    optimized_metric: str | None = _f()  # what a sweep optimises (null: best-val's best)
    paths: PathsConf = field(default_factory=PathsConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    data: Any = MISSING
    checkpoint: CadenceConf = field(default_factory=CadenceConf)
    stages: Any = MISSING
    resume: ResumeConf = field(default_factory=ResumeConf)
    tracking: Any = None
    verify: VerifyConf = field(default_factory=VerifyConf)


def _check_node(schema, node: dict, prefix: str, errors: list[str]) -> None:
    node = as_written_now(node)
    known = [f.name for f in fields(schema)]
    for key in sorted(set(node) - set(known) - {"_target_"}):  # a `+key=` typo passes Hydra
        near = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {prefix}{near[0]}?" if near else ""
        errors.append(f"{prefix}{key}: no such key{hint}")
    for f in [f for f in fields(schema) if f.name in node]:
        value, check = node[f.name], f.metadata.get("check")
        if check is not None and (why := check(value)):
            errors.append(f"{prefix}{f.name}={value!r}: {why}")
        if isinstance(value, dict) and (typed := SCHEMAS.get(str(value.get("_target_")))):
            _check_node(typed, value, f"{prefix}{f.name}.", errors)
    if (cross := getattr(schema, "cross", None)) and not any(e.startswith(prefix) for e in errors):
        errors.extend(cross(node))


def _absent(node, key: str = "") -> dict | None:
    """{field: its `absent`} of `node`'s schema (trainer's by `key`, else its `_target_`'s); None: it has none."""
    schema = SCHEMAS.get(str(node.get("_target_"))) if isinstance(node, dict) else None
    schema = TrainerConf if key == "trainer" else schema
    if schema is None:
        return None
    return {f.name: f.metadata["absent"] for f in fields(schema) if "absent" in f.metadata}


def as_written_now(node, key: str = ""):
    """A node (at the top-level `key`) with each key it lacks (or holds null) at its schema's `absent`."""
    if (absent := _absent(node, key)) is None:
        return node
    return {**node, **{k: v for k, v in absent.items() if node.get(k) is None}}


def config_written_now(config: dict) -> dict:
    """A whole config (a checkpoint's, say) with every node as_written_now: what a tool builds from."""
    return {k: as_written_now(node, k) for k, node in config.items()}


def as_written_before(config: dict) -> dict:
    """The config less every key at its schema's `absent`: a key added later at the old behaviour is no change."""
    out = dict(config)
    for key, node in config.items():
        if (absent := _absent(node, key)) is not None:
            out[key] = {k: v for k, v in node.items() if not (k in absent and absent[k] == v)}
    return out


LIVE = {  # kind -> (live values it must take, those it is given if it takes them): assemble._call
    "model": (("spec", "dtype", "rng"), ()),
    "optimizer": (("params",), ()),
    "scheduler": (("optimizer",), ("run_total_steps",)),
    "data": ((), ("cache_dir",)),
    "tracking": ((), ("sweep",)),
}


def takes(factory) -> dict[str, inspect.Parameter] | None:
    """The keyword parameters a constructor takes (None: any, it has **kwargs; {}: no signature to read)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    return None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else dict(params)


def live_problem(kind: str, target: str, factory) -> str | None:
    """Why `factory` cannot be a `kind` (it takes not every live value its kind is given), or None."""
    accepted = takes(factory)
    if not (lacking := [k for k in LIVE[kind][0] if accepted is not None and k not in accepted]):
        return None
    given = f"every {kind} is given {', '.join(LIVE[kind][0])} (the live-argument interface, docs/own-model.md)"
    return f"{kind}._target_={target} takes no {lacking[0]!r}: {given}; add it to its constructor (or **kwargs)"


def check_live(config: dict) -> None:
    """ConfigError for a part whose class lacks a live value of its kind (one it cannot import: the job's to say)."""
    from hydra._internal.utils import _locate  # get_class, less its log line of a failed import

    for kind, (needed, _) in LIVE.items():
        node = config.get(kind)
        if not (needed and isinstance(node, dict) and isinstance(node.get("_target_"), str)):
            continue
        try:
            cls = _locate(node["_target_"])
        except Exception:
            continue
        if problem := live_problem(kind, node["_target_"], cls):
            raise ConfigError(problem)


def validate(config: dict) -> None:
    """ConfigError listing every value out of range (its field's `check`), before the job creates anything."""
    errors: list[str] = []
    if "name" in config and (why := names.problem(config["name"])):
        errors.append(f"name={names.shown(config['name'])}: {why}")
    fixed = dict(trainer=TrainerConf, resume=ResumeConf, checkpoint=CadenceConf, verify=VerifyConf)
    nodes: list[tuple[str, Any]] = [(k, config.get(k)) for k in (*fixed, *LIVE)]  # LIVE: the parts
    nodes += [(f"stages.{name}", node) for name, node in (config.get("stages") or {}).items()]
    for key, node in nodes:
        if not isinstance(node, dict):
            continue
        if schema := fixed.get(key) or SCHEMAS.get(str(node.get("_target_"))):
            # a stage added by override (+stages.NAME={...}) is not typed while composing: it names every key
            keys = ", ".join(f.name for f in fields(schema))
            missing = ", ".join(n for n in keys.split(", ") if n not in as_written_now(node))
            if key.startswith("stages.") and missing:
                errors.append(f"{key}: no {missing} (a {node['_target_']} stage takes {keys})")
            _check_node(schema, node, f"{key}.", errors)
    if errors:
        raise ConfigError("; ".join(errors))
    check_live(config)


SCHEMAS: Mapping[str, Any] = MappingProxyType(dict(_BUILDING))  # read-only from here on
del _BUILDING
