"""Where the config lives, and the resolvers and schemas Hydra needs before composing it."""
from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import schema

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "conf"
STARTED = time.strftime("%Y%m%d-%H%M%S")  # one value per process: resume=never's fresh directory suffix


def run_name(config: dict) -> str:
    """The run directory's name: <name>-<semantic hash>, plus a timestamp when resume=never."""
    from pipeline.identity import run_id

    rid = run_id(config)
    return f"{rid}-{STARTED}" if config.get("resume", {}).get("source") == "never" else rid


def _run_name_resolver(*, _root_: DictConfig) -> str:
    config = {k: OmegaConf.to_container(_root_[k], resolve=True, enum_to_str=True) if isinstance(_root_[k], DictConfig)
              else _root_[k] for k in _root_ if k != "hydra"}
    return run_name(config)


def register_all() -> None:
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", _run_name_resolver)
    schema.register()
