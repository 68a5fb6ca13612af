"""manifest.json is the truth about the run: every field the issue lists, each recomputed independently."""
from __future__ import annotations

import hashlib
import json
import platform
import re
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from pipeline.checkpoint import facts, io
from pipeline.roundtrip import facts_for, train

PROJECT_ROOT = Path(__file__).resolve().parents[2]
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def compose(*overrides: str):
    try:
        from conftest import compose_config  # tests/conftest.py: the real config, as python -m pipeline composes it
    except ImportError:
        from pipeline.roundtrip import compose as compose_config
    return compose_config(list(overrides))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from pipeline.build import build_state

    root = tmp_path_factory.mktemp("manifest")
    cfg = compose("experiment=kernodeck", f"paths.output_dir={root}")
    state = build_state(cfg)
    train(state, 7)
    state.metrics.update({"train/loss": 0.25, "val/loss": 0.5})
    directory = root / io.step_dir_name(7)
    sha = io.save(state, directory, facts_for(cfg, state, root))
    return {"state": state, "directory": directory, "sha": sha,
            "manifest": json.loads((directory / io.MANIFEST).read_text())}


def test_schema_step_epoch_metrics_seed(saved):
    m, state = saved["manifest"], saved["state"]
    assert m["schema_version"] == "1.0"
    assert (m["step"], m["epoch"]) == (7, state.iterator.epoch) == (7, 1)  # 6 batches of 4 per epoch
    assert m["metrics"] == {"train/loss": 0.25, "val/loss": 0.5}
    assert m["seed"] == 42 == m["config"]["trainer"]["seed"]
    assert "mlflow_run_uri" in m and m["mlflow_run_uri"] is None


def test_config_hash_is_sha256_of_canonical_json_of_the_config(saved):
    m = saved["manifest"]
    canonical = json.dumps(m["config"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert m["config_hash"] == hashlib.sha256(canonical).hexdigest()
    assert m["config"]["name"] == "kernodeck" and m["config"]["model"]["hidden"] == [8]  # resolved, plain


def test_data_manifest_hash_is_the_datasets(saved):
    assert saved["manifest"]["data_manifest_hash"] == saved["state"].dataset.manifest_hash
    assert HEX64.match(saved["manifest"]["data_manifest_hash"])


def test_git_sha_and_dirty_flag(saved, tmp_path):
    m = saved["manifest"]
    if (PROJECT_ROOT / ".git").exists():
        assert re.match(r"^[0-9a-f]{40}$", m["git_sha"]) and isinstance(m["git_dirty"], bool)
    else:
        assert m["git_sha"] == "unknown"
    assert facts.git_info(str(tmp_path)) == {"git_sha": "unknown", "git_dirty": None}  # outside a checkout


def test_versions(saved):
    v = saved["manifest"]["versions"]
    assert set(v) == {"python", "numpy", "safetensors", "hydra-core", "omegaconf", "mlflow"}
    assert v["python"] == platform.python_version() and v["numpy"] == np.__version__
    for name in ("safetensors", "hydra-core", "omegaconf"):
        assert v[name] == metadata.version(name)


def test_hardware(saved):
    hw = saved["manifest"]["hardware"]
    assert isinstance(hw["cpu"], str) and hw["cpu"]
    assert isinstance(hw["cores"], int) and hw["cores"] >= 1
    assert isinstance(hw["ram_gb"], (int, float)) and hw["ram_gb"] > 0
    assert isinstance(hw["blas"], list) and hw["blas"], "no BLAS library found by threadpoolctl"
    for lib in hw["blas"]:
        assert lib["library"] and isinstance(lib["threads"], int) and lib["threads"] >= 1


def test_files_lists_size_and_sha256_of_every_other_file(saved):
    directory, m = saved["directory"], saved["manifest"]
    others = {p.name for p in directory.iterdir()} - {io.MANIFEST}
    assert set(m["files"]) == others == {io.WEIGHTS, io.OPTIM, io.EXTRA}
    for name, entry in m["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_checkpoint_hash_is_sha256_of_the_weights_file(saved):
    data = (saved["directory"] / io.WEIGHTS).read_bytes()
    assert saved["sha"] == hashlib.sha256(data).hexdigest() == saved["manifest"]["files"][io.WEIGHTS]["sha256"]


def test_extra_json_holds_the_json_state_machines(saved):
    extra = json.loads((saved["directory"] / io.EXTRA).read_text())
    state = saved["state"]
    assert extra["step"] == 7 and extra["scheduler"] == state.scheduler.state_dict()
    assert extra["data_iter"]["permutation"] == state.iterator.permutation.tolist()
    assert set(extra["rng"]) == set(state.streams.names())
    for name in state.streams.np:  # 128-bit integers as decimal strings
        assert isinstance(extra["rng"][name]["state"], str) and isinstance(extra["rng"][name]["inc"], str)
    assert extra["optimizer"] == {"lr": state.optimizer.lr, "t": 7}


def test_equal_states_give_equal_bytes(saved, tmp_path):
    """Deterministic files: the same state saved twice (another process would do the same) hashes the same."""
    state, m = saved["state"], saved["manifest"]
    facts_ = {k: m[k] for k in m if k not in ("schema_version", "step", "epoch", "metrics", "files")}
    io.save(state, tmp_path / "again", facts_)
    again = json.loads((tmp_path / "again" / io.MANIFEST).read_text())
    assert again["files"] == m["files"]
