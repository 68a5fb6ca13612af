"""A run directory's lock as read by the tools and the tracking agent: a planted FIFO or link is never waited on."""

from __future__ import annotations

import hashlib
import os

import pytest

from pipeline.run.directory import RunDir
from pipeline.tracking.agent import _held_by


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_lock_that_is_not_a_file_reads_as_free_without_blocking(tmp_path, planted):
    run = tmp_path / "run"
    run.mkdir()
    if planted == "fifo":
        os.mkfifo(run / ".lock")  # open(2) for reading would wait here for a writer forever
    else:
        (tmp_path / "elsewhere").write_text(str(os.getpid()))
        (run / ".lock").symlink_to(tmp_path / "elsewhere")
    assert RunDir(run).in_use() is False
    assert _held_by(run, os.getpid()) is False
    assert os.path.lexists(run / ".lock")  # read, never changed


def test_a_held_lock_is_in_use_until_released(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.acquire()
    try:
        assert rundir.in_use() is True
    finally:
        rundir.release()
    assert rundir.in_use() is False


def test_claim_writes_the_pid_the_config_and_the_overrides_and_opens_the_log(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.acquire()
    try:
        with rundir.claim("a: 1\n", ["optimizer.lr=0.1", "x='y z'"]) as log:
            log.write("first line\n")
        assert (rundir.path / ".lock").read_text() == f"{os.getpid()}\n"
        assert (rundir.path / ".hydra" / "config.yaml").read_text() == "a: 1\n"
        assert (
            rundir.path / ".hydra" / "overrides.yaml"
        ).read_text() == '- "optimizer.lr=0.1"\n- "x=\'y z\'"\n'
        assert (rundir.path / "pipeline.log").read_text() == "first line\n"
    finally:
        rundir.release()


def test_forget_removes_only_a_directory_that_acquire_created_and_left_empty(tmp_path):
    made = RunDir(tmp_path / "made")
    made.acquire()
    made.forget()
    assert not made.path.exists()  # a refused run leaves no directory behind
    found = RunDir(tmp_path / "found")
    found.path.mkdir()
    found.acquire()
    found.forget()
    assert sorted(os.listdir(found.path)) == [
        ".lock"
    ]  # one it found stays (its lock is never a run's record)


def test_a_run_finds_its_corpus_by_its_hash_in_its_output_directorys_corpus_cache(tmp_path):
    manifest = b'{"files": {}}'
    (tmp_path / "out" / "data" / "grammar-1").mkdir(parents=True)
    (tmp_path / "out" / "data" / "grammar-1" / "MANIFEST.json").write_bytes(manifest)
    sha = hashlib.sha256(manifest).hexdigest()
    assert (
        RunDir(tmp_path / "out" / "runs" / "r").corpus(sha)
        == tmp_path / "out" / "data" / "grammar-1"
    )
    assert RunDir(tmp_path / "out" / "runs" / "r").corpus("0" * 64) is None
    assert RunDir(tmp_path / "out" / "r").corpus(sha) is None  # not in an output directory's runs/
