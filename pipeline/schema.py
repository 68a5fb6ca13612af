"""Dataclass schemas registered in Hydra's ConfigStore: a typo'd key or a wrong type fails before training."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Dtype(Enum):
    float32 = "float32"
    float64 = "float64"


class Activation(Enum):
    tanh = "tanh"
    relu = "relu"


@dataclass
class PathsConf:
    output_dir: str = "${project_root:}/outputs"  # everything a run writes lives under here
    runs_dir: str = "${.output_dir}/runs"


@dataclass
class TrainerConf:
    seed: int = 0
    max_steps: int = 0  # > 0 wins over epochs
    epochs: int = 1
    batch_size: int = 32
    dtype: Dtype = Dtype.float32
    eval_every: int = 0  # steps between evaluations; 0 = at the end of every epoch
    log_every: int = 10  # steps between metrics.jsonl lines (and tracking points)
    progress_bar: Optional[bool] = None  # None: a tqdm bar on a terminal, plain log lines otherwise


# --- model
@dataclass
class MLPConf:
    _target_: str = "pipeline.model.mlp.MLP"
    hidden: list[int] = field(default_factory=lambda: [8])
    activation: Activation = Activation.tanh
    dropout: float = 0.0


@dataclass
class MiniGPTConf:
    _target_: str = "pipeline.model.minigpt.MiniGPT"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    attn_dropout: Optional[float] = None
    init_std: float = 0.02


# --- optimizer
@dataclass
class SGDConf:
    _target_: str = "pipeline.optimizer.sgd.SGD"
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass
class AdamConf:
    _target_: str = "pipeline.optimizer.adam.Adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class AdamWConf(AdamConf):
    _target_: str = "pipeline.optimizer.adam.AdamW"
    weight_decay: float = 0.01


# --- scheduler
@dataclass
class ConstantConf:
    _target_: str = "pipeline.scheduler.constant.Constant"


@dataclass
class StepConf:
    _target_: str = "pipeline.scheduler.step.StepLR"
    step_size: int = 3
    gamma: float = 0.5


@dataclass
class CosineConf:
    _target_: str = "pipeline.scheduler.cosine.WarmupCosine"
    total_steps: Optional[int] = None  # None: the run's total number of updates
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


# --- data
@dataclass
class RegressionConf:
    _target_: str = "pipeline.data.regression.Regression"
    n_rows: int = 24
    seed: int = 3
    noise: float = 0.05
    input_gain: float = 0.02
    input_noise: float = 0.01


@dataclass
class CorpusConf:
    """What every token corpus on disk shares (written once under <output_dir>/data/)."""

    _target_: str = MISSING
    output_dir: str = "${paths.output_dir}"
    val_fraction: float = 0.1
    block_size: int = 64
    ngram_order: int = 4
    val_batch_size: int = 32


@dataclass
class GrammarConf(CorpusConf):
    _target_: str = "pipeline.data.grammar.GrammarCorpus"
    seed: int = 1234
    n_sentences: int = 60000


@dataclass
class TextConf(CorpusConf):
    _target_: str = "pipeline.data.text.TextCorpus"
    path: str = MISSING
    ngram_order: int = 5


@dataclass
class ResumeConf:
    source: str = "auto"  # auto: newest checkpoint that verifies | never: a fresh directory | a checkpoint path
    allow_changes: list[str] = field(default_factory=list)  # dotted keys allowed to differ from the checkpoint


@dataclass
class CadenceConf:
    _target_: str = "pipeline.stages.cadence.Cadence"
    every_epochs: int = 1
    every_steps: int = 0


@dataclass
class VerifyConf:
    cut: int = 5  # updates before the interruption
    steps: int = 10  # updates in all
    atol: float = 0.0  # exact by default
    rtol: float = 0.0
    kill: str = "none"  # none | random: chaos mode, SIGKILL at random points and re-run until complete
    trials: int = 20
    seed: int = 0  # chooses the chaos kill points
    max_reruns: int = 5


@dataclass
class Config:
    name: str = "default"  # the experiment's name: the first part of the run directory's name
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


SCHEMAS = {
    "model": {"mlp": MLPConf, "minigpt": MiniGPTConf},
    "optimizer": {"sgd": SGDConf, "adam": AdamConf, "adamw": AdamWConf},
    "scheduler": {"constant": ConstantConf, "step": StepConf, "cosine": CosineConf},
    "data": {"regression": RegressionConf, "grammar": GrammarConf, "text": TextConf},
}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
