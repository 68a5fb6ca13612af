"""Typed schemas for every config node (Hydra's ConfigStore) and the value checks run before anything starts.

The dataclasses hold types only (every default is MISSING): values live in the YAML under conf/. Hydra checks
types and keys while composing (`optimizer.lr=abc`, `model.nonexistent=1` fail naming the key);
`validate(config)` then checks ranges on the resolved plain config, one line per bad value naming the key,
the value and what is allowed, before the job creates anything on disk. A field's check is in its metadata.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import MISSING

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pipeline/
PROJECT_ROOT = PACKAGE_DIR.parent  # the checkout, when the package runs from one
# conf/ sits at the top of a checkout; a wheel carries it inside the package (setup.py maps it there).
CONFIG_DIR = PACKAGE_DIR / "conf" if (PACKAGE_DIR / "conf").is_dir() else PROJECT_ROOT / "conf"


class ConfigError(ValueError):
    """A config value out of range, or groups that do not go together (one line per problem)."""


def error_line(e: BaseException) -> str:
    """A composition error as one line: Hydra's message, its cause, the key at fault, and for an unknown
    option of a group the options there are (Hydra lists them on lines of their own)."""
    parts = [str(e).strip().splitlines()[0].rstrip(".:")] if str(e).strip() else [type(e).__name__]
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0].rstrip(".:"))
    key = getattr(e, "full_key", None) or getattr(cause, "full_key", None)
    line = ": ".join(parts) + (f" (key {key})" if key and key not in " ".join(parts) else "")
    options = getattr(e, "options", None)  # hydra's MissingConfigException: the group's options, if it has any
    missing = getattr(e, "missing_cfg_file", None)
    if options:
        where = f" in '{missing.rsplit('/', 1)[0]}'" if missing and "/" in missing else ""
        line += f"; available options{where}: {', '.join(options)}"
    return line


# --- checks: value -> None, or what is allowed ------------------------------------------------------

def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def at_least(lo) -> Callable:
    return lambda v: None if _num(v) and math.isfinite(v) and v >= lo else f"must be a number >= {lo}"


def above(lo) -> Callable:
    return lambda v: None if _num(v) and math.isfinite(v) and v > lo else f"must be a finite number > {lo}"


def null_or_at_least(lo) -> Callable:
    return lambda v: None if v is None or at_least(lo)(v) is None else f"must be null or a number >= {lo}"


def fraction(v) -> str | None:
    return None if _num(v) and 0 <= v < 1 else "must be in [0, 1)"


def probability_list(v) -> str | None:
    return None if isinstance(v, list) and len(v) == 2 and all(fraction(x) is None for x in v) \
        else "must be two numbers in [0, 1)"


def widths(v) -> str | None:
    return None if isinstance(v, list) and all(isinstance(x, int) and x >= 1 for x in v) \
        else "must be a list of layer widths >= 1"


def one_of(*options) -> Callable:
    return lambda v: None if v in options else f"must be one of {', '.join(map(str, options))}"


def duration_or_null(v) -> str | None:
    from pipeline.run.budget import parse_duration

    if v is None:
        return None
    try:
        parse_duration(v)
    except ValueError as e:
        return str(e)
    return None


def _f(check: Callable | None = None):
    return field(default=MISSING, metadata={"check": check} if check else {})


class Dtype(Enum):
    float32 = "float32"
    float64 = "float64"


class Activation(Enum):
    tanh = "tanh"
    relu = "relu"


class Mode(Enum):
    min = "min"
    max = "max"


# stop: a non-finite loss or metric ends the run (failed), keeping the last good checkpoints; continue: goes on
NonFinite = Enum("NonFinite", {"stop": "stop", "continue": "continue"})


class KillMode(Enum):
    none = "none"
    random = "random"


@dataclass
class PathsConf:
    output_dir: str = _f()
    runs_dir: str = _f()


@dataclass
class TrainerConf:
    seed: int = _f(at_least(0))
    max_steps: int = _f(at_least(0))  # > 0 wins over epochs
    epochs: int = _f(at_least(0))
    batch_size: int = _f(at_least(1))
    dtype: Dtype = _f()
    eval_every: int = _f(at_least(0))
    log_every: int = _f(at_least(0))
    progress_bar: Optional[bool] = _f()
    on_nonfinite: NonFinite = _f()
    max_time: Optional[str] = _f(duration_or_null)  # DD:HH:MM:SS of this process's wall time; null = no budget
    accumulate: int = _f(at_least(1))  # micro-batches (of batch_size) per update
    grad_clip: float = _f(at_least(0))  # the largest global L2 norm of a gradient; 0 = no clipping
    shards: int = _f(at_least(1))  # pieces each micro-batch is split into: semantic (summation order, dropout)
    threads: Optional[int] = _f(null_or_at_least(1))  # threads running the pieces: not semantic; null = the cores

    @staticmethod
    def cross(c: dict) -> list[str]:
        if c["max_steps"] == 0 and c["epochs"] == 0:
            return ["trainer.max_steps=0 and trainer.epochs=0: give one of them > 0 (the run would train nothing)"]
        return []


# --- model
@dataclass
class MLPConf:
    _target_: str = _f()
    hidden: list[int] = _f(widths)
    activation: Activation = _f()
    dropout: float = _f(fraction)


@dataclass
class MiniGPTConf:
    _target_: str = _f()
    n_layer: int = _f(at_least(1))
    n_head: int = _f(at_least(1))
    n_embd: int = _f(at_least(1))
    block_size: Optional[int] = _f()  # null: the data's sequence length
    dropout: float = _f(fraction)
    attn_dropout: Optional[float] = _f()
    init_std: float = _f(above(0))

    @staticmethod
    def cross(c: dict) -> list[str]:
        out = []
        if c["n_embd"] % c["n_head"]:
            out.append(f"model.n_embd={c['n_embd']} is not divisible by model.n_head={c['n_head']}")
        if c["attn_dropout"] is not None and fraction(c["attn_dropout"]):
            out.append(f"model.attn_dropout={c['attn_dropout']}: must be in [0, 1)")
        if c["block_size"] is not None and c["block_size"] < 1:
            out.append(f"model.block_size={c['block_size']}: must be >= 1 (or null: the data's)")
        return out


# --- optimizer
@dataclass
class SGDConf:
    _target_: str = _f()
    lr: float = _f(above(0))
    momentum: float = _f(at_least(0))
    dampening: float = _f(at_least(0))
    nesterov: bool = _f()
    weight_decay: float = _f(at_least(0))


@dataclass
class AdamConf:
    _target_: str = _f()
    lr: float = _f(above(0))
    betas: list[float] = _f(probability_list)
    eps: float = _f(above(0))
    weight_decay: float = _f(at_least(0))


@dataclass
class AdamWConf(AdamConf):
    pass


# --- scheduler
@dataclass
class ConstantConf:
    _target_: str = _f()


@dataclass
class StepConf:
    _target_: str = _f()
    step_size: int = _f(at_least(1))
    gamma: float = _f(above(0))


@dataclass
class CosineConf:
    _target_: str = _f()
    total_steps: Optional[int] = _f()  # None: the run's total number of updates
    warmup_steps: int = _f(at_least(0))
    min_lr_ratio: float = _f(at_least(0))
    num_cycles: float = _f(above(0))


# --- data
@dataclass
class RegressionConf:
    _target_: str = _f()
    n_rows: int = _f(at_least(2))
    seed: int = _f(at_least(0))
    noise: float = _f(at_least(0))
    input_gain: float = _f(fraction)
    input_noise: float = _f(at_least(0))


@dataclass
class CorpusConf:
    """What every token corpus on disk shares (written once under <output_dir>/data/)."""

    _target_: str = _f()
    val_fraction: float = _f(lambda v: None if _num(v) and 0 < v < 1 else "must be in (0, 1)")
    block_size: int = _f(at_least(1))
    ngram_order: int = _f(at_least(1))
    val_batch_size: int = _f(at_least(1))


@dataclass
class GrammarConf(CorpusConf):
    seed: int = _f(at_least(0))
    n_sentences: int = _f(at_least(1))


TEXT_MAX_BYTES = 32 << 20  # data=text's default bound on data.path (see conf/data/text.yaml)


@dataclass
class TextConf(CorpusConf):
    path: str = _f()
    max_bytes: Optional[int] = _f(null_or_at_least(1))  # null (a config from before the key): TEXT_MAX_BYTES


# --- stages, cadence, resume
@dataclass
class CadenceConf:
    _target_: str = _f()
    every_epochs: int = _f(at_least(0))
    every_steps: int = _f(at_least(0))


@dataclass
class ResumeStageConf:
    _target_: str = _f()
    source: str = _f()
    allow_changes: list[str] = _f()
    order: int = _f()


@dataclass
class TrainStageConf:
    _target_: str = _f()
    eval_every: int = _f(at_least(0))
    order: int = _f()


@dataclass
class RotateStageConf:
    _target_: str = _f()
    keep: int = _f(at_least(1))
    cadence: Any = MISSING  # the `checkpoint` group's node
    order: int = _f()


@dataclass
class BestValStageConf:
    _target_: str = _f()
    monitor: str = _f()
    mode: Mode = _f()
    order: int = _f()


@dataclass
class EarlyStopStageConf:
    _target_: str = _f()
    monitor: str = _f()
    mode: Mode = _f()
    patience: int = _f(at_least(1))
    min_delta: float = _f(at_least(0))
    order: int = _f()


@dataclass
class FinalStageConf:
    _target_: str = _f()
    order: int = _f()


@dataclass
class ResumeConf:
    source: str = _f()  # auto: newest checkpoint that verifies | never: a fresh directory | a checkpoint path
    allow_changes: list[str] = _f()  # dotted keys allowed to differ from the checkpoint


# --- tracking
@dataclass
class MlflowTrackingConf:
    _target_: str = _f()
    uri: str = _f()
    artifact_location: Optional[str] = _f()
    experiment: str = _f()
    wait: float = _f(at_least(0))  # seconds a job waits on tracking in all


@dataclass
class NoTrackingConf:
    _target_: str = _f()


@dataclass
class VerifyConf:
    cut: int = _f(at_least(1))  # updates before the interruption
    steps: int = _f(at_least(2))  # updates in all
    atol: float = _f(at_least(0))  # exact by default
    rtol: float = _f(at_least(0))
    kill: KillMode = _f()  # none | random: chaos mode, SIGKILL at random points and re-run until complete
    trials: int = _f(at_least(1))
    seed: int = _f(at_least(0))  # chooses the chaos kill points
    max_reruns: int = _f(at_least(1))


@dataclass
class Config:
    name: str = _f()  # the experiment's name: the first part of the run directory's name
    optimized_metric: Optional[str] = _f()  # what a sweep optimises (null: best-val's best)
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


# group -> option -> schema; each conf/<group>/<option>.yaml starts from its schema in `defaults`
SCHEMAS = {
    "model": {"mlp": MLPConf, "minigpt": MiniGPTConf},
    "optimizer": {"sgd": SGDConf, "adam": AdamConf, "adamw": AdamWConf},
    "scheduler": {"constant": ConstantConf, "step": StepConf, "cosine": CosineConf},
    "data": {"regression": RegressionConf, "grammar": GrammarConf, "text": TextConf},
    "stage": {"resume": ResumeStageConf, "train": TrainStageConf, "rotate": RotateStageConf,
              "best_val": BestValStageConf, "early_stop": EarlyStopStageConf, "final": FinalStageConf},
    "tracking": {"mlflow": MlflowTrackingConf, "none": NoTrackingConf},
}
# `_target_` -> schema, to check group nodes (and stages) by what they build
BY_TARGET = {
    "pipeline.model.mlp.MLP": MLPConf, "pipeline.model.minigpt.MiniGPT": MiniGPTConf,
    "pipeline.optimizer.sgd.SGD": SGDConf, "pipeline.optimizer.adam.Adam": AdamConf,
    "pipeline.optimizer.adam.AdamW": AdamWConf, "pipeline.scheduler.constant.Constant": ConstantConf,
    "pipeline.scheduler.step.StepLR": StepConf, "pipeline.scheduler.cosine.WarmupCosine": CosineConf,
    "pipeline.data.regression.Regression": RegressionConf, "pipeline.data.grammar.GrammarCorpus": GrammarConf,
    "pipeline.data.text.TextCorpus": TextConf, "pipeline.stages.resume.Resume": ResumeStageConf,
    "pipeline.stages.train.Train": TrainStageConf, "pipeline.stages.rotate.RotateLastN": RotateStageConf,
    "pipeline.stages.best.BestVal": BestValStageConf, "pipeline.stages.final.Final": FinalStageConf,
    "pipeline.stages.early_stop.EarlyStop": EarlyStopStageConf,
    "pipeline.stages.cadence.Cadence": CadenceConf,
    "pipeline.tracking.mlflow_tracker.MlflowTracker": MlflowTrackingConf,
    "pipeline.tracking.base.NullTracker": NoTrackingConf,
}


def _check_node(schema, node: dict, prefix: str, errors: list[str]) -> None:
    for f in fields(schema):
        if f.name not in node:
            continue
        value = node[f.name]
        check = f.metadata.get("check")
        if check is not None and (why := check(value)):
            errors.append(f"{prefix}{f.name}={value!r}: {why}")
        if isinstance(value, dict) and isinstance(value.get("_target_"), str) and value["_target_"] in BY_TARGET:
            _check_node(BY_TARGET[value["_target_"]], value, f"{prefix}{f.name}.", errors)
    cross = getattr(schema, "cross", None)
    if cross is not None and not any(e.startswith(prefix) for e in errors):
        errors.extend(cross(node))


def validate(config: dict) -> None:
    """Raise ConfigError listing every value out of range (one line each); changes nothing anywhere."""
    errors: list[str] = []
    for key, schema in (("trainer", TrainerConf), ("resume", ResumeConf), ("checkpoint", CadenceConf),
                        ("verify", VerifyConf)):
        if isinstance(config.get(key), dict):
            _check_node(schema, config[key], f"{key}.", errors)
    for key in ("model", "optimizer", "scheduler", "data", "tracking"):
        node = config.get(key)
        if isinstance(node, dict) and node.get("_target_") in BY_TARGET:
            _check_node(BY_TARGET[node["_target_"]], node, f"{key}.", errors)
    for name, node in (config.get("stages") or {}).items():
        if isinstance(node, dict) and node.get("_target_") in BY_TARGET:
            _check_node(BY_TARGET[node["_target_"]], node, f"stages.{name}.", errors)
    if errors:
        raise ConfigError("; ".join(errors))


def in_checkout() -> bool:
    """True when the package runs from a source checkout, False when installed (from a wheel)."""
    return (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "conf").is_dir()


def install_hint(extra: str) -> str:
    """How to add an optional extra, matching how this pipeline was installed: an editable install (PEP 610's
    direct_url.json says so) or an uninstalled checkout gets `pip install -e ".[extra]"` in its directory, a
    wheel or an index install `pip install 'pipeline[extra]'` (pip keeps the installed pipeline)."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    try:
        direct = json.loads(importlib.metadata.distribution("pipeline").read_text("direct_url.json") or "null")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        direct = None
    url = urlparse(direct.get("url", "")) if isinstance(direct, dict) else None
    if url and url.scheme == "file" and (direct.get("dir_info") or {}).get("editable"):
        project = Path(unquote(url.path))
    elif direct is None and in_checkout():
        project = PROJECT_ROOT
    else:
        return f"pip install 'pipeline[{extra}]'"
    return f'pip install -e ".[{extra}]" in {project}'


def default_output_dir() -> str:
    """<checkout>/outputs when the package runs from a source checkout, else outputs/ in the working directory."""
    if in_checkout():
        return str(PROJECT_ROOT / "outputs")
    return str(Path(os.getcwd()) / "outputs")


def to_plain(cfg) -> dict:
    """A composed DictConfig as plain dicts and lists, interpolations resolved, enums as their values, the
    `hydra` node left out. Raises omegaconf's errors (they name the key) for a missing or unresolvable value."""
    from omegaconf import OmegaConf

    def values(node):
        if isinstance(node, dict):
            return {k: values(v) for k, v in node.items() if k != "hydra"}
        if isinstance(node, list):
            return [values(v) for v in node]
        return node.value if isinstance(node, Enum) else node

    return values(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))


def compose(overrides=(), return_hydra_config: bool = False):
    """conf/config.yaml composed with `overrides`, exactly as `python -m pipeline` would (nothing written)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="pipeline"):
        return hydra_compose(config_name="config", overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


def register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("default_output_dir"):
        OmegaConf.register_new_resolver("default_output_dir", default_output_dir)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
