"""Lab 02 block G: a save interrupted at its rename leaves no checkpoint; a save killed outright leaves a
temporary that readers ignore and the next save removes; a visible checkpoint directory always verifies.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from pipeline.checkpoint import io
from pipeline.checkpoint.atomic import TMP_PREFIX
from pipeline.roundtrip import facts_for, train
from pipeline.stages.context import list_checkpoints

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MLP = ["experiment=kernodeck"]


def compose(*overrides: str):
    try:
        from conftest import compose_config  # tests/conftest.py: the real config, as python -m pipeline composes it
    except ImportError:
        from pipeline.roundtrip import compose as compose_config
    return compose_config(list(overrides))


@pytest.fixture
def run(tmp_path):
    from pipeline.build import build_state

    cfg = compose(*MLP, f"paths.output_dir={tmp_path}")
    state = build_state(cfg)
    train(state, 4)
    parent = tmp_path / "checkpoints"
    return state, parent, parent / io.step_dir_name(state.step), facts_for(cfg, state, tmp_path)


def temporaries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP_PREFIX)) if parent.is_dir() else []


def test_interrupted_rename_leaves_nothing_and_the_next_save_succeeds(run):
    state, parent, directory, facts = run
    with mock.patch("os.rename", side_effect=KeyboardInterrupt), \
            mock.patch("os.replace", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            io.save(state, directory, facts)
    assert not directory.exists()
    assert list_checkpoints(parent) == []
    assert temporaries(parent) == []  # the interrupted save removed its own temporary on the way out
    sha = io.save(state, directory, facts)
    assert io.verify(directory)["files"][io.WEIGHTS]["sha256"] == sha
    assert temporaries(parent) == [] and [p for _, p in list_checkpoints(parent)] == [directory]


def test_temporary_of_a_save_that_ran_no_cleanup_is_ignored_then_removed(run):
    state, parent, directory, facts = run
    # As if killed at the rename: no except-clause cleanup runs.
    with mock.patch("os.rename", side_effect=KeyboardInterrupt), \
            mock.patch("pipeline.checkpoint.io.shutil.rmtree"):
        with pytest.raises(KeyboardInterrupt):
            io.save(state, directory, facts)
    left = temporaries(parent)
    assert len(left) == 1 and left[0].startswith(f"{TMP_PREFIX}{directory.name}-")
    assert (parent / left[0] / io.MANIFEST).is_file()  # complete, but never renamed: still not a checkpoint
    assert not directory.exists() and list_checkpoints(parent) == []
    io.save(state, directory, facts)
    assert temporaries(parent) == []
    io.verify(directory)


def test_damaged_checkpoint_at_the_same_step_is_replaced(run):
    state, parent, directory, facts = run
    io.save(state, directory, facts)
    good = (directory / io.WEIGHTS).read_bytes()
    (directory / io.WEIGHTS).write_bytes(good[:-4] + b"\0\0\0\1")
    sha = io.save(state, directory, facts)
    assert (directory / io.WEIGHTS).read_bytes() == good and io.verify(directory)
    assert temporaries(parent) == [] and sha == io.verify(directory)["files"][io.WEIGHTS]["sha256"]


def test_intact_checkpoint_at_the_same_step_is_kept(run):
    state, parent, directory, facts = run
    first = io.save(state, directory, facts)
    inode = (directory / io.WEIGHTS).stat().st_ino
    assert io.save(state, directory, facts) == first
    assert (directory / io.WEIGHTS).stat().st_ino == inode and temporaries(parent) == []


KILLED_SAVE = r"""
import json, sys
from hydra import compose, initialize_config_dir
import pipeline.config
from pipeline.build import build_state, plain
from pipeline.checkpoint import io
from pipeline.facts import run_facts
from pipeline.trainer.loop import train_step

overrides, directory = json.loads(sys.argv[1]), sys.argv[2]
pipeline.config.register_all()
with initialize_config_dir(config_dir=str(pipeline.config.CONFIG_DIR), version_base="1.3", job_name="killed"):
    cfg = compose(config_name="config", overrides=overrides)
state = build_state(cfg)
for _ in range(4):
    train_step(state)
io.save(state, directory, run_facts(plain(cfg), state.dataset.manifest_hash, directory))
"""

SAVE_POINTS = {1: "after weights", 3: "before manifest", 4: "before rename", 5: "after rename"}


@pytest.mark.parametrize("k", sorted(SAVE_POINTS), ids=list(SAVE_POINTS.values()))
def test_save_killed_with_sigkill(run, tmp_path, k):
    """A real kill -9 inside io.save (pipeline.chaos's k-th save point): all or nothing is visible."""
    state, parent, directory, facts = run
    env = {**os.environ, "PIPELINE_CHAOS": f"save:{k}",
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PIPELINE_CHAOS_TRACE", None)
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, json.dumps([*MLP, f"paths.output_dir={tmp_path}"]),
                           str(directory)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if SAVE_POINTS[k] == "after rename":
        assert [p for _, p in list_checkpoints(parent)] == [directory]
        io.verify(directory)  # visible means complete
        assert temporaries(parent) == []
        return
    assert not directory.exists() and list_checkpoints(parent) == []
    assert len(temporaries(parent)) == 1
    io.save(state, directory, facts)  # the next save cleans up and succeeds
    assert temporaries(parent) == []
    io.verify(directory)
