"""`python -m pipeline [overrides]`: the Hydra entry point."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from pipeline.config import CONFIG_DIR, register_all


register_all()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    from pipeline.app import run  # imported here so `--help` and `--cfg` stay fast

    return run(cfg)


if __name__ == "__main__":
    main()
