"""The run-level manifest fields, computed once per run and written into every checkpoint."""
from __future__ import annotations

from pipeline.checkpoint import facts as f
from pipeline.config import PROJECT_ROOT
from pipeline.identity import semantic_hash


def run_facts(config: dict, data_manifest_hash: str, run_dir: str) -> dict:
    return {
        **f.git_info(str(PROJECT_ROOT)),
        "config_hash": f.config_hash(config),
        "semantic_config_hash": semantic_hash(config),
        "data_manifest_hash": data_manifest_hash,
        "seed": config["trainer"]["seed"],
        "versions": f.versions(),
        "config": config,
        "hardware": f.hardware(),
        "mlflow_run_uri": None,
        "run_dir": run_dir,
    }
