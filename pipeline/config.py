"""Where the config lives, and the resolvers and schemas Hydra needs before composing it."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from pipeline import schema

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "conf"


def register_all() -> None:
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
    schema.register()
