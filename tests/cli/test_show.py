"""`python -m pipeline.show PATH`: a checkpoint's manifest and verification, a run's checkpoints; reads only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import KERNODECK, run_pipeline, the_run

from pipeline.checkpoint.directory import MANIFEST, WEIGHTS, step_dir_name
from pipeline.cli import show as pinspect


@pytest.fixture(scope="module")
def finished_run(finished_job) -> Path:
    """A real kernodeck run: checkpoints at steps 6 (end of epoch 0) and 10, best and final links, run.json."""
    return the_run(finished_job(*KERNODECK))


@pytest.fixture
def run_dir(finished_run, tmp_path) -> Path:
    copy = tmp_path / finished_run.name
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


def snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (
                os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None,
                st.st_mtime_ns,
                st.st_mode,
            )
    return out


def inspect_json(path: Path) -> tuple[int, dict]:
    import contextlib
    import io as stdio

    buf = stdio.StringIO()
    with contextlib.redirect_stdout(buf):
        code = pinspect.main([str(path), "--json"])
    return code, json.loads(buf.getvalue())


def test_run_directory(run_dir, capsys):
    before = snapshot(run_dir)
    assert pinspect.main([str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "status: complete" in text and "step 10/10" in text
    code, d = inspect_json(run_dir)
    assert code == 0 and d["kind"] == "run" and d["valid"]
    assert d["run"]["status"] == "complete"
    steps = [c["step"] for c in d["checkpoints"]]
    assert steps == [6, 10]
    for c in d["checkpoints"]:
        manifest = json.loads(
            (run_dir / "checkpoints" / step_dir_name(c["step"]) / MANIFEST).read_text()
        )
        assert (
            c["valid"] and c["metrics"] == manifest["metrics"] and c["epoch"] == manifest["epoch"]
        )
    assert d["links"]["final"] == {"target": step_dir_name(10), "exists": True}
    assert "final" in d["checkpoints"][-1]["links"]
    assert snapshot(run_dir) == before  # inspecting writes nothing
    assert inspect_json(run_dir / "checkpoints")[1]["kind"] == "run"  # checkpoints/ means its run


def test_checkpoint_directory(run_dir, capsys):
    directory = run_dir / "checkpoints" / "final"
    assert pinspect.main([str(directory)]) == 0
    text = capsys.readouterr().out
    manifest = json.loads((directory / MANIFEST).read_text())
    for value in (
        manifest["config_hash"],
        manifest["data_manifest_hash"],
        manifest["git_sha"],
        manifest["files"][WEIGHTS]["sha256"],
        "step 10",
        "epoch 1",
        "val/loss=",
    ):
        assert str(value) in text, value
    assert text.strip().splitlines()[-1].startswith("valid")
    code, d = inspect_json(directory)
    assert code == 0 and d["valid"] and d["reason"] is None and d["step"] == 10
    assert d["link_target"] == step_dir_name(10) and d["files"] == manifest["files"]
    assert d["checkpoint_hash"] == manifest["files"][WEIGHTS]["sha256"]


def test_corrupted_checkpoint(run_dir, capsys):
    directory = run_dir / "checkpoints" / step_dir_name(6)
    path = directory / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # one bit of tensor data
    path.write_bytes(bytes(data))
    before = snapshot(run_dir)
    assert pinspect.main([str(directory)]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        f"INVALID: checkpoint {directory}: "
        "weights.safetensors: sha256 differs from manifest.json (corrupted)"
    )
    code, d = inspect_json(run_dir)
    assert code == 1 and not d["valid"]
    bad, good = d["checkpoints"]
    assert not bad["valid"] and "weights.safetensors" in bad["reason"] and bad["step"] == 6
    assert good["valid"] and good["step"] == 10
    assert snapshot(run_dir) == before


def test_checkpoint_without_manifest(run_dir, capsys):
    directory = run_dir / "checkpoints" / step_dir_name(6)
    (directory / MANIFEST).unlink()
    assert pinspect.main([str(directory)]) == 1
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("manifest.json: missing (an incomplete or foreign directory)")
    )


def test_dangling_link_and_temporaries_are_reported_not_touched(run_dir, capsys):
    ckpts = run_dir / "checkpoints"
    os.symlink(step_dir_name(99), ckpts / ".tmp-best-x")
    os.replace(ckpts / ".tmp-best-x", ckpts / "best")  # best -> a step that does not exist
    (ckpts / ".tmp-step-00000011-abcd1234").mkdir()
    before = snapshot(run_dir)
    assert pinspect.main([str(run_dir)]) == 1
    text = capsys.readouterr().out
    assert "best -> step-00000099  (MISSING" in text and ".tmp-step-00000011-abcd1234" in text
    assert snapshot(run_dir) == before


def test_not_a_directory(tmp_path, capsys):
    assert pinspect.main([str(tmp_path / "nothing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_as_a_module_from_any_directory(run_dir, tmp_path):
    """`python -m pipeline.show` runs, and the package's module does not shadow the standard `inspect`."""
    directory = run_dir / "checkpoints" / step_dir_name(10)
    proc = run_pipeline([str(directory)], tmp_path / "cwd", module="pipeline.show")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("valid")
    (directory / "stray.txt").write_text("x")
    proc = run_pipeline([str(directory)], tmp_path / "cwd", module="pipeline.show")
    assert proc.returncode == 1 and "stray.txt: present but not listed" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    import inspect as std_inspect

    assert hasattr(std_inspect, "signature") and std_inspect is not pinspect


def test_inspect_runs_the_full_verification_against_the_config(run_dir, capsys):
    """A checkpoint whose tensors are well-formed and hashed but not what its config builds is invalid."""
    import hashlib

    import numpy as np
    from safetensors.numpy import load_file, save_file

    directory = run_dir / "checkpoints" / step_dir_name(6)
    arrays = load_file(str(directory / WEIGHTS))
    arrays["layers.0.weight"] = np.zeros((2, 9))  # another width than the config's model.hidden=[8]
    (directory / WEIGHTS).unlink()
    save_file(arrays, str(directory / WEIGHTS))
    m = json.loads((directory / MANIFEST).read_text())
    data = (directory / WEIGHTS).read_bytes()
    m["files"][WEIGHTS] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / MANIFEST).write_text(json.dumps(m))
    assert pinspect.main([str(directory)]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_an_edited_manifest_is_invalid(run_dir, capsys):
    """Regression (#10.4): editing `config` in manifest.json passed inspect."""
    directory = run_dir / "checkpoints" / step_dir_name(10)
    m = json.loads((directory / MANIFEST).read_text())
    m["config"]["optimizer"]["lr"] = 0.5
    (directory / MANIFEST).write_text(json.dumps(m))
    assert pinspect.main([str(directory)]) == 1
    assert "config_hash" in capsys.readouterr().out
