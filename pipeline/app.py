"""One job: build the run from the composed config, run its stages in order, return the monitored metric."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from pipeline.build import build_state, plain
from pipeline.checkpoint.errors import CheckpointError
from pipeline.config import run_name
from pipeline.facts import run_facts
from pipeline.preemption import EXIT_PREEMPTED, Preemption
from pipeline.run_lock import RunBusyError, RunLock
from pipeline.stages.context import RunContext
from pipeline.stages.resume import DriftError
from pipeline.tracking.base import NullTracker
from pipeline.trainer.loop import StopTraining
from pipeline.trainer.metrics_log import MetricsLog
from pipeline.trainer.progress import Progress

log = logging.getLogger("pipeline")
EXIT_BAD_INPUT = 2


def run_dir_for(config: dict) -> Path:
    """<runs_dir>/<name>-<semantic hash>; resume=never gets a fresh sibling with a timestamp."""
    return Path(config["paths"]["runs_dir"]) / run_name(config)


def run(cfg: DictConfig, run_dir: Path | None = None) -> float:
    config = plain(cfg)
    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(config)
    try:
        with RunLock(run_dir):
            return _run_locked(cfg, config, run_dir)
    except (RunBusyError, DriftError, CheckpointError) as e:
        print(f"pipeline: {e}", file=sys.stderr)  # one sentence, on stderr; nothing on disk was changed
        sys.exit(EXIT_BAD_INPUT)


def build_stages(cfg) -> list:
    """Every node under `stages`, named by its key (its state in checkpoints is filed under that name)."""
    stages = []
    for key, node in cfg.stages.items():
        if node is not None:
            stage = instantiate(plain(node))
            stage.name = str(key)
            stages.append(stage)
    return sorted(stages, key=lambda s: s.order)


def _run_locked(cfg: DictConfig, config: dict, run_dir: Path) -> float:
    state = build_state(cfg)
    facts = run_facts(config, state.dataset.manifest_hash, str(run_dir))
    stages = build_stages(cfg)
    ctx = RunContext(state, run_dir, facts, stages)
    for s in stages:
        s.setup(ctx)
    tracker = instantiate(plain(cfg.tracking)) if cfg.get("tracking") is not None else NullTracker()
    if ctx.complete:
        print(f"run {run_dir} is complete at step {state.step}: "
              + " ".join(f"{k}={v:.6g}" for k, v in sorted(state.metrics.items())))
        return float(state.metrics.get("val/loss", float("nan")))
    trainer_cfg = config["trainer"]
    resumed = ctx.resumed_manifest or {}
    tracker.start(config=config, facts=facts, run_dir=run_dir, previous_run_uri=resumed.get("mlflow_run_uri"))
    preemption = Preemption()
    # Only the last save (end of training, or preemption) waits for the tracked run's URI: earlier manifests
    # carry it once the tracker knows it, so the training loop never waits for mlflow to start.
    ctx.before_save.append(lambda: facts.update(mlflow_run_uri=tracker.run_uri(
        timeout=30.0 if state.step >= state.total_steps or preemption.received is not None else 0.0)))
    ctx.extra_sinks.append(tracker.log_checkpoint)
    callbacks = [MetricsLog(run_dir / "metrics.jsonl", trainer_cfg["log_every"], sinks=[tracker.log_line]),
                 Progress(trainer_cfg["progress_bar"], trainer_cfg["log_every"]), preemption]
    ctx.write_status("running")
    preemption.install()
    try:
        for s in stages:
            if hasattr(s, "run"):
                s.run(ctx, callbacks)
    except StopTraining as stop:
        directory = ctx.checkpoint()
        ctx.write_status("preempted")
        tracker.finish("KILLED", run_dir)
        log.warning("preempted by %s at step %d: checkpoint %s; re-run the same command to resume (exit %d)",
                    stop, state.step, directory, EXIT_PREEMPTED)
        sys.exit(EXIT_PREEMPTED)
    except BaseException:
        ctx.write_status("failed")
        tracker.finish("FAILED", run_dir)
        raise
    finally:
        for cb in callbacks:
            getattr(cb, "close", lambda: None)()
    try:
        for s in stages:
            s.finish(ctx)
    except BaseException:
        tracker.finish("FAILED", run_dir)
        raise
    finally:
        preemption.uninstall()
    tracker.finish("FINISHED", run_dir)
    log.info("done at step %d: %s", state.step, " ".join(f"{k}={v:.6g}" for k, v in sorted(state.metrics.items())))
    return float(state.metrics.get("val/loss", float("nan")))
