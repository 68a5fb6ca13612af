"""manifest.json is the truth about the run: every field the issue lists, each recomputed independently,
and a manifest that contradicts itself refused."""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import re
import subprocess
from importlib import metadata

import numpy as np
import pytest
from conftest import KERNODECK, PROJECT_ROOT, the_run

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import DATA, EXTRA, MANIFEST, OPTIM, WEIGHTS
from pipeline.run.directory import RunDir

HEX64 = re.compile(r"^[0-9a-f]{64}$")


@pytest.fixture(scope="module")
def saved(finished_job):
    out = finished_job(*KERNODECK)  # read, never changed
    directory = RunDir(the_run(out)).store.link_dir("final")
    return {
        "directory": directory,
        "manifest": json.loads((directory / MANIFEST).read_text()),
        "out": out,
    }


def test_step_epoch_metrics_tags_seed(saved):
    m = saved["manifest"]
    assert m["schema_version"] == mf.SCHEMA_VERSION == "2.1"
    assert (m["step"], m["epoch"]) == (10, 1)  # 6 batches of 4 per epoch
    assert set(m["metrics"]) == {
        "train/loss",
        "lr",
        "grad_norm",
        "val/loss",
    }  # measured at this step
    assert m["tags"] == ["best_val", "final"]  # the stages that asked for it
    assert m["seed"] == 42 == m["config"]["trainer"]["seed"]
    assert "mlflow_run_uri" in m and m["mlflow_run_uri"] is None  # tracking=none
    assert HEX64.match(m["lineage"]["id"]) and m["lineage"]["origin"] is None


def test_config_hash_is_sha256_of_canonical_json_of_the_config(saved):
    m = saved["manifest"]
    canonical = json.dumps(
        m["config"], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    assert m["config_hash"] == hashlib.sha256(canonical).hexdigest()
    assert m["config"]["name"] == "kernodeck" and m["config"]["model"]["hidden"] == [
        8
    ]  # resolved, plain
    assert the_run(saved["out"]).name == f"kernodeck-{m['semantic_config_hash'][:12]}"


def test_data_manifest_hash_and_spec(saved):
    m = saved["manifest"]
    assert HEX64.match(m["data_manifest_hash"])
    assert m["data_spec"] == {
        "n_features": 2,
        "n_targets": 1,
        "vocab_size": 0,
        "block_size": 0,
        "n_train": 24,
    }


def test_git_sha_and_dirty_flag(saved, tmp_path):
    m = saved["manifest"]
    if (PROJECT_ROOT / ".git").exists():
        assert re.match(r"^[0-9a-f]{40}$", m["git_sha"]) and isinstance(m["git_dirty"], bool)
    else:
        assert m["git_sha"] == "unknown"
    assert mf.git_info(str(tmp_path)) == {
        "git_sha": "unknown",
        "git_dirty": None,
    }  # outside a checkout
    # An installed package inside a virtualenv inside someone's repository: that repository is not the code's.
    site = tmp_path / "project" / ".venv" / "lib" / "python3"
    site.mkdir(parents=True)
    git = ["git", "-C", str(tmp_path / "project"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "theirs"], check=True)
    assert mf.git_info(str(site)) == {"git_sha": "unknown", "git_dirty": None}


def test_versions(saved):
    v = saved["manifest"]["versions"]
    assert set(v) == {
        "python",
        "pipeline",
        "numpy",
        "safetensors",
        "hydra-core",
        "omegaconf",
        "mlflow",
    }
    assert v["python"] == platform.python_version() and v["numpy"] == np.__version__
    for name in ("safetensors", "hydra-core", "omegaconf"):
        assert v[name] == metadata.version(name)


def test_hardware(saved):
    hw = saved["manifest"]["hardware"]
    assert isinstance(hw["cpu"], str) and hw["cpu"]
    assert isinstance(hw["cores"], int) and hw["cores"] >= 1
    assert isinstance(hw["ram_gb"], (int, float)) and hw["ram_gb"] > 0
    assert isinstance(hw["blas"], list) and hw["blas"], "no BLAS library found by threadpoolctl"


def test_files_lists_size_and_sha256_of_every_other_file(saved):
    directory, m = saved["directory"], saved["manifest"]
    others = {p.name for p in directory.iterdir()} - {MANIFEST}
    assert set(m["files"]) == others == {WEIGHTS, OPTIM, EXTRA, DATA}
    for name, entry in m["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


_GONE = object()


def edited(m: dict, path: tuple, value=_GONE):
    """A copy of manifest `m` with the value at `path` set to `value` (removed if none given; () is `value`)."""
    if not path:
        return value
    x = copy.deepcopy(m)
    node = x
    for k in path[:-1]:
        node = node[k]
    if value is _GONE:
        node.pop(path[-1])
    else:
        node[path[-1]] = value
    return x


# what: (where, the value put there, the start of the message of the one check that must refuse it)
BAD_MANIFESTS = {
    "config edited": (
        ("config", "optimizer", "lr"),
        1.0,
        "'config_hash' is not the sha256 of 'config'",
    ),
    "hash edited": (("config_hash",), "0" * 64, "'config_hash' is not the sha256 of 'config'"),
    "semantic hash edited": (
        ("semantic_config_hash",),
        "0" * 64,
        "'semantic_config_hash' does not match 'config'",
    ),
    "seed edited": (("seed",), 1, "'seed' 1 differs from config trainer.seed 42"),
    "negative step": (("step",), -1, "'step' and 'epoch' must be non-negative"),
    "step a string": (("step",), "10", "'step' must be a non-negative integer, got '10'"),
    "step a bool": (("step",), True, "'step' must be a non-negative integer, got True"),
    "epoch a bool": (("epoch",), False, "'epoch' must be a non-negative integer, got False"),
    "metric a string": (("metrics", "val/loss"), "low", "metric 'val/loss': 'low' is not a number"),
    "metric a bool": (("metrics", "val/loss"), True, "metric 'val/loss': True is not a number"),
    "tags not names": (("tags",), [1], "'tags' must be a list of stage names"),
    "no lineage": (("lineage",), _GONE, "'lineage' must be an object, got None"),
    "files not an object": (("files",), [], "'files' must be an object, got []"),
    "other version": (("schema_version",), "1.0", "schema_version '1.0': this pipeline reads"),
    "not an object": ((), [], "not a JSON object"),
}


def test_a_manifest_is_checked_against_itself(saved):
    m = saved["manifest"]
    assert mf.check(copy.deepcopy(m)) == m


@pytest.mark.parametrize("path, value, message", BAD_MANIFESTS.values(), ids=list(BAD_MANIFESTS))
def test_a_manifest_that_contradicts_itself_is_refused_by_its_check(saved, path, value, message):
    """Each damage is refused by the check made for it (its message), not by whichever check it trips first."""
    with pytest.raises(mf.ManifestError, match=f"^{re.escape(message)}"):
        mf.check(edited(saved["manifest"], path, value))


def test_non_finite_metrics_are_strings_read_back_exactly():
    from pipeline.files import jsonio

    text = jsonio.dumps({"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5})
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    back = {k: jsonio.number(v) for k, v in jsonio.loads(text).items()}
    assert (
        np.isnan(back["a"])
        and back["b"] == float("inf")
        and back["c"] == -float("inf")
        and back["d"] == 1.5
    )


def test_a_manifest_without_its_semantic_hash_is_refused_before_that_hash_is_computed(
    saved, monkeypatch
):
    m = copy.deepcopy(saved["manifest"])
    del m["semantic_config_hash"]
    monkeypatch.setattr(
        mf, "semantic_hash", lambda *a: pytest.fail("the hash of a config not checked")
    )
    with pytest.raises(
        mf.ManifestError, match=r"^'semantic_config_hash' must be a sha256 hex digest"
    ):
        mf.check(m)
