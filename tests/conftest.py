"""Shared fixtures: the real config composed with Hydra, and `python -m pipeline` run as a subprocess.

Nothing here writes into the repository: compose() writes nothing at all, and every subprocess run
is started from a fresh temporary cwd (so a test also proves outputs do not depend on the cwd);
callers pass `paths.output_dir=<tmp>` for anything that trains.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import hypothesis
import pytest
from hydra import compose, initialize_config_dir

import pipeline.config

# Hypothesis keeps no example database and writes its caches outside the repository.
hypothesis.configuration.set_hypothesis_home_dir(tempfile.mkdtemp(prefix="pipeline-tests-hypothesis-"))
hypothesis.settings.register_profile("pipeline", database=None, deadline=None)
hypothesis.settings.load_profile("pipeline")

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # tests/ -> the project root, independent of pipeline.config


def compose_config(overrides: Sequence[str] = (), return_hydra_config: bool = False):
    """The real conf/config.yaml composed with `overrides`, exactly as `python -m pipeline` would."""
    pipeline.config.register_all()
    with initialize_config_dir(config_dir=str(pipeline.config.CONFIG_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


@pytest.fixture
def compose_cfg() -> Callable:
    """compose_cfg("experiment=kernodeck", f"paths.output_dir={tmp_path}") -> DictConfig."""

    def _compose(*overrides: str, return_hydra_config: bool = False):
        return compose_config(overrides, return_hydra_config=return_hydra_config)

    return _compose


def run_pipeline(args: Sequence[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m pipeline *args` from `cwd`, with text output captured and HYDRA_FULL_ERROR unset.

    PYTHONPATH starts with this checkout so the subprocess runs this tree's `pipeline`, whatever is installed.
    """
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    Path(cwd).mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cli(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """cli(*args) runs `python -m pipeline *args` from an empty tmp cwd (tmp_path/"cwd")."""

    def _run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_pipeline(args, cwd if cwd is not None else tmp_path / "cwd", timeout=timeout)

    return _run


@pytest.fixture(scope="session")
def pipeline_runner() -> Callable[..., subprocess.CompletedProcess]:
    """run_pipeline itself, for module- or session-scoped fixtures (pass cwd= explicitly)."""
    return run_pipeline
