"""Writes that never follow a planted link nor leave a torn file (pipeline/files/atomic.py)."""
from __future__ import annotations

import errno
import os

import pytest

from pipeline.files.atomic import (TMP_PREFIX, UnsafePathError, discard_dir, ensure_dirs, new_temp_dir, open_append,
                             publish_dir, remove_temporaries, replace_file, replace_link, write_new)


@pytest.fixture
def victim(tmp_path):
    """A file outside the directory the pipeline writes in, which a planted link points at."""
    v = tmp_path / "victim.txt"
    v.write_text("precious")
    return v


def test_write_new_refuses_anything_already_there(tmp_path, victim):
    (tmp_path / "d").mkdir()
    os.symlink(victim, tmp_path / "d" / "f")
    with pytest.raises(UnsafePathError):
        write_new(tmp_path / "d" / "f", b"x")
    assert victim.read_text() == "precious"
    entry = write_new(tmp_path / "d" / "g", b"abc")
    assert entry["size"] == 3 and (tmp_path / "d" / "g").read_bytes() == b"abc"


def test_replace_file_never_writes_through_a_link(tmp_path, victim):
    os.symlink(victim, tmp_path / "run.json")
    with pytest.raises(UnsafePathError, match="symlink"):
        replace_file(tmp_path / "run.json", b"{}")
    assert victim.read_text() == "precious"
    # a planted temporary-looking link is irrelevant: temporaries get fresh random names
    os.symlink(victim, tmp_path / ".status.json.tmp")
    replace_file(tmp_path / "status.json", b"{}")
    assert victim.read_text() == "precious" and (tmp_path / "status.json").read_bytes() == b"{}"
    replace_file(tmp_path / "status.json", b"[]")
    assert (tmp_path / "status.json").read_bytes() == b"[]"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_open_append_refuses_a_link(tmp_path, victim):
    os.symlink(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(UnsafePathError):
        open_append(tmp_path / "metrics.jsonl")
    with open_append(tmp_path / "log") as f:
        f.write("a\n")
    with open_append(tmp_path / "log") as f:
        f.write("b\n")
    assert (tmp_path / "log").read_text() == "a\nb\n" and victim.read_text() == "precious"


def test_ensure_dirs_refuses_links_below_the_root_but_not_the_root(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "out")  # the user's output directory on another disk: fine
    assert ensure_dirs(tmp_path / "out", "runs", "r1").is_dir()
    os.symlink(elsewhere, tmp_path / "out" / "runs" / "r2")  # a planted run directory: not fine
    with pytest.raises(UnsafePathError):
        ensure_dirs(tmp_path / "out", "runs", "r2")


def test_publish_discard_and_link(tmp_path):
    tmp = new_temp_dir(tmp_path, "step-1")
    (tmp / "a").write_text("1")
    publish_dir(tmp, tmp_path / "step-1")
    assert (tmp_path / "step-1" / "a").read_text() == "1"
    tmp = new_temp_dir(tmp_path, "step-1")
    (tmp / "a").write_text("2")
    with pytest.raises(UnsafePathError):
        publish_dir(tmp, tmp_path / "step-1")
    publish_dir(tmp, tmp_path / "step-1", replace=True)
    assert (tmp_path / "step-1" / "a").read_text() == "2"
    replace_link(tmp_path / "best", "step-1")
    assert os.readlink(tmp_path / "best") == "step-1"
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UnsafePathError):
        replace_link(tmp_path / "plain", "step-1")
    discard_dir(tmp_path / "step-1")
    assert not (tmp_path / "step-1").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_remove_temporaries_does_not_follow_links(tmp_path, victim):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(outside, d / f"{TMP_PREFIX}evil")
    (d / f"{TMP_PREFIX}dir").mkdir()
    os.symlink(victim, d / f"{TMP_PREFIX}dir" / "v")
    remove_temporaries(d)
    assert list(d.iterdir()) == [] and (outside / "keep").exists() and victim.read_text() == "precious"


def test_a_refusal_reads_as_one_sentence_without_an_errno_prefix(tmp_path):
    """What the tools print after "pipeline: " is str(e): the path and the reason, never "[Errno 40] ..."."""
    from pipeline.files.atomic import refuse_link
    from pipeline.files.reading import UnreadableFile

    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError) as caught:
        refuse_link(tmp_path / "link", "file")
    assert str(caught.value) == f"{tmp_path / 'link'} is a symlink; refusing to follow it (remove it)"
    assert caught.value.errno == errno.ELOOP  # the code is kept for callers that branch on it
    assert str(UnreadableFile(errno.EINVAL, "is a FIFO, not a regular file", "/p")) == "/p: is a FIFO, not a regular file"
