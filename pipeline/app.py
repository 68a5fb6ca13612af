"""One job: build the run from the composed config, train it, and return the monitored metric."""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline.build import build_state, plain
from pipeline.trainer.loop import Trainer
from pipeline.trainer.metrics_log import MetricsLog
from pipeline.trainer.progress import Progress

log = logging.getLogger("pipeline")


def run(cfg: DictConfig) -> float:
    trainer_cfg = plain(cfg.trainer)
    run_dir = Path(plain(cfg.paths)["runs_dir"]) / cfg.name
    state = build_state(cfg)
    metrics = MetricsLog(run_dir / "metrics.jsonl", trainer_cfg["log_every"])
    progress = Progress(trainer_cfg["progress_bar"], trainer_cfg["log_every"])
    Trainer(trainer_cfg["eval_every"], [metrics, progress]).fit(state)
    log.info("done: %s", " ".join(f"{k}={v:.6g}" for k, v in sorted(state.metrics.items())))
    return float(state.metrics.get("val/loss", float("nan")))
