"""Writes that never follow a planted link nor leave a torn file (pipeline/files/atomic.py)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import env_for_subprocess, wait_until

from pipeline.files import atomic
from pipeline.files.atomic import (
    TMP_PREFIX,
    UnsafePathError,
    discard_dir,
    ensure_dirs,
    new_temp_dir,
    open_append,
    publish_dir,
    remove_temporaries,
    replace_file,
    replace_link,
    write_new,
)


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
    assert (
        list(d.iterdir()) == [] and (outside / "keep").exists() and victim.read_text() == "precious"
    )


def test_a_refusal_reads_as_one_sentence_without_an_errno_prefix(tmp_path):
    """What the tools print after "pipeline: " is str(e): the path and the reason, never "[Errno 40] ..."."""
    from pipeline.files.atomic import refuse_link
    from pipeline.files.reading import UnreadableFile

    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError) as caught:
        refuse_link(tmp_path / "link", "file")
    assert (
        str(caught.value) == f"{tmp_path / 'link'} is a symlink; refusing to follow it (remove it)"
    )
    assert caught.value.errno == errno.ELOOP  # the code is kept for callers that branch on it
    assert (
        str(UnreadableFile(errno.EINVAL, "is a FIFO, not a regular file", "/p"))
        == "/p: is a FIFO, not a regular file"
    )


# --- the durability order of a save ---------------------------------------------------------------------------
# A crash may come between any two system calls, and the kernel may write a directory's entries to disk in any
# order until they are fsynced. So a save must fsync every file, then the temporary directory (its entries),
# then rename it into place, then fsync the parent (the rename); and a replace must rename the old step aside,
# never delete it, until the new one is in place. Nothing else here would notice a missing fsync.


class Syscalls:
    """The fsyncs (by the path the fd names), renames and tree removals of a save, in the order they returned.

    `invariant` (if set) is asserted before and after every rename and removal: a crash can come at any of them."""

    def __init__(self, monkeypatch):
        import shutil

        self.events: list[tuple] = []
        self.invariant = None
        real = {
            "fsync": os.fsync,
            "rename": os.rename,
            "replace": os.replace,
            "unlink": os.unlink,
            "rmtree": shutil.rmtree,
        }

        def fsync(fd):
            where = os.readlink(f"/proc/self/fd/{fd}")  # before the call: the fd is still open
            real["fsync"](fd)
            self.events.append(("fsync", where))

        def moved(kind):
            def call(src, dst, *args, **kwargs):
                self.check(f"before {kind} {src} -> {dst}")
                real[kind](src, dst, *args, **kwargs)
                self.events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
                self.check(f"after {kind} {src} -> {dst}")

            return call

        def removed(kind):
            def call(path, *args, **kwargs):
                self.check(f"before {kind} {path}")
                fd = kwargs.get("dir_fd")  # rmtree removes by names relative to a directory's fd
                where = (
                    os.path.realpath(path)
                    if fd is None
                    else os.path.join(os.readlink(f"/proc/self/fd/{fd}"), path)
                )
                real[kind](path, *args, **kwargs)
                self.events.append(("remove", where))
                self.check(f"after {kind} {path}")

            return call

        real_exchange = atomic._exchange

        def exchange(a, b):  # one step: `b` is the new directory, the old one now under `a`'s name
            self.check(f"before exchange {a} <-> {b}")
            swapped = real_exchange(a, b)
            if swapped:
                self.events.append(("rename", os.path.realpath(a), os.path.realpath(b)))
                self.events.append(("exchange", os.path.realpath(b), os.path.realpath(a)))
            self.check(f"after exchange {a} <-> {b}")
            return swapped

        monkeypatch.setattr(atomic, "_exchange", exchange)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", moved("rename"))
        monkeypatch.setattr(os, "replace", moved("replace"))
        monkeypatch.setattr(os, "unlink", removed("unlink"))
        monkeypatch.setattr(shutil, "rmtree", removed("rmtree"))

    def check(self, when: str) -> None:
        if self.invariant is not None and not self.invariant():
            why, self.invariant = (
                self.invariant.__doc__,
                None,
            )  # once: the save's own clean-up runs next
            raise AssertionError(f"{when}: {why}")

    def index(self, *event) -> int:
        assert event in self.events, f"{event} never happened: {self.events}"
        return self.events.index(event)


@pytest.fixture
def syscalls(monkeypatch) -> Syscalls:
    return Syscalls(monkeypatch)


@pytest.fixture(scope="module")
def tiny_state(tmp_path_factory):
    """What CheckpointDir.write is given: the state tree and manifest fields of a fresh kernodeck job
    (nothing trained)."""
    from conftest import KERNODECK

    from pipeline.config.compose import compose, to_plain
    from pipeline.stateful import capture
    from pipeline.verify.worker import Fresh

    out = tmp_path_factory.mktemp("state")
    run = Fresh(to_plain(compose([*KERNODECK, f"paths.output_dir={out}"])))
    return capture(run.parts), run.fields()


def inodes(parent) -> dict[int, str]:
    return {os.lstat(os.path.join(parent, n)).st_ino: n for n in os.listdir(parent)}


def assert_saved_in_durable_order(events: Syscalls, final) -> int:
    """Every file fsynced, then the temporary directory, then the rename into `final`, then the parent; returns
    the index of the parent's fsync."""
    final = os.path.realpath(final)
    parent = os.path.dirname(final)
    (tmp,) = [e[1] for e in events.events if e[0] == "rename" and e[2] == final]
    assert os.path.basename(tmp).startswith(TMP_PREFIX), (
        "the new step is written under a temporary name"
    )
    names = sorted(os.listdir(final))
    last_file = max(
        events.index("fsync", os.path.join(tmp, n)) for n in names
    )  # each file fsynced in the temporary
    tmp_synced = events.index("fsync", tmp)
    renamed = events.index("rename", tmp, final)
    parent_synced = events.events.index(("fsync", parent), renamed)
    assert last_file < tmp_synced < renamed < parent_synced, events.events
    return parent_synced


def test_a_checkpoint_is_fsynced_file_by_file_then_its_directory_then_renamed_then_the_parent(
    tmp_path, syscalls, tiny_state
):
    """Without the temporary directory's fsync a crash after the rename can leave a step with missing files."""
    from pipeline.checkpoint.directory import MANIFEST, CheckpointDir, step_dir_name

    final = tmp_path / "checkpoints" / step_dir_name(3)
    CheckpointDir(final).write(*tiny_state)
    assert (
        MANIFEST in os.listdir(final) and len(os.listdir(final)) >= 4
    )  # weights, optim, extra, data, manifest
    assert_saved_in_durable_order(syscalls, final)


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "rename-aside"])
def test_replacing_a_checkpoint_never_leaves_a_moment_without_a_complete_step(
    tmp_path, syscalls, tiny_state, swap, monkeypatch
):
    """A crash at any moment of a replace leaves a complete step N: with the filesystem's exchange, step N itself
    at every instant; without it (rename-aside), the old one at worst renamed aside, never deleted first."""
    from pipeline.checkpoint.directory import MANIFEST, CheckpointDir, step_dir_name

    if not swap:
        monkeypatch.setattr(
            atomic, "_renameat2", lambda: None
        )  # a filesystem or libc without renameat2
    final = tmp_path / "checkpoints" / step_dir_name(3)
    CheckpointDir(final).write(*tiny_state)
    old = os.lstat(final).st_ino
    syscalls.events.clear()

    def complete():
        """no complete step N at this instant"""
        return os.path.isfile(final / MANIFEST)

    def survives():
        """neither a complete step N nor the old one renamed aside (deleted before the new one was in place)"""
        name = inodes(final.parent).get(old)
        return complete() or (name is not None and os.path.isfile(final.parent / name / MANIFEST))

    syscalls.invariant = complete if swap else survives
    CheckpointDir(final).write(*tiny_state, replace=True)
    syscalls.invariant = None
    parent_synced = assert_saved_in_durable_order(syscalls, final)
    assert os.lstat(final).st_ino != old and old not in inodes(
        final.parent
    )  # the new step, the old one gone
    real = os.path.realpath(final)
    # The old one left (swapped out, or renamed aside before the new one came in), and was removed only once
    # the new one was durable.
    aside = [e for e in syscalls.events if e[0] in ("rename", "exchange") and e[1] == real]
    assert len(aside) == 1 and os.path.basename(aside[0][2]).startswith(TMP_PREFIX), syscalls.events
    assert aside[0][0] == ("exchange" if swap else "rename")
    (came_in,) = [e for e in syscalls.events if e[0] == "rename" and e[2] == real]
    if swap:
        assert (
            syscalls.index(*aside[0]) == syscalls.index(*came_in) + 1
        )  # one step, recorded as two
    else:
        assert syscalls.index(*aside[0]) < syscalls.index(*came_in)
    assert syscalls.index("remove", aside[0][2]) > parent_synced
    assert [n for n in os.listdir(final.parent) if n.startswith(TMP_PREFIX)] == []


def test_publish_dir_keeps_the_same_order_for_any_directory(tmp_path, syscalls):
    """The order lives in publish_dir itself, not only in the checkpoint store's use of it."""
    for round_ in ("new", "replaced"):
        syscalls.events.clear()
        tmp = new_temp_dir(tmp_path, "step-1")
        write_new(tmp / "a", round_.encode())
        write_new(tmp / "MANIFEST.json", b"{}")
        publish_dir(tmp, tmp_path / "step-1", replace=True)
        assert (tmp_path / "step-1" / "a").read_bytes() == round_.encode()
        assert_saved_in_durable_order(syscalls, tmp_path / "step-1")


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard-link", "copy"])
def test_a_second_name_holds_the_bytes_after_the_first_is_replaced(
    tmp_path, monkeypatch, hard_links
):
    """What superseded/ keeps of a file that is then rewritten (replace_file: a new inode) keeps its old bytes."""
    from pipeline.files.atomic import replace_file, second_name

    src = tmp_path / "metrics.jsonl"
    src.write_bytes(b"old\n")
    if not hard_links:  # a filesystem without hard links

        def no_link(*a, **k):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    second_name(src, tmp_path / "kept")
    replace_file(src, b"new\n")
    assert (tmp_path / "kept").read_bytes() == b"old\n" and src.read_bytes() == b"new\n"
    os.symlink(tmp_path / "kept", tmp_path / "link")
    try:  # never read through a link: a second name of the link itself, or refused
        second_name(tmp_path / "link", tmp_path / "through")
        assert os.path.islink(tmp_path / "through")
    except OSError as e:
        assert e.errno == errno.ELOOP


# --- a link replaced (checkpoints/best, final): never missing, whatever runs beside it or kills it ------------


def test_every_system_call_of_a_link_replacement_leaves_the_link(tmp_path, syscalls):
    """A crash can come at any rename or removal: before and after each, the link names the old or new target."""
    link = tmp_path / "best"
    replace_link(link, "step-1")

    def named():
        """the link is missing (or names neither step)"""
        return os.path.islink(link) and os.readlink(link) in ("step-1", "step-2")

    syscalls.invariant = named
    replace_link(link, "step-2")
    syscalls.invariant = None
    assert os.readlink(link) == "step-2"


READER = """
import json, os, sys
link, ready, stop = sys.argv[1:]
seen = {}
open(ready, "w").close()
while not os.path.exists(stop):
    for _ in range(1000):
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            target = "missing"
        seen[target] = seen.get(target, 0) + 1
print(json.dumps(seen))
"""


def test_a_reader_never_finds_a_link_missing_while_it_is_replaced(tmp_path):
    """A second process reads the link in a loop (as `sample RUN/checkpoints/best` would) while it is replaced
    hundreds of times: it sees both targets, and never no link."""
    link, ready, stop = tmp_path / "best", tmp_path / "ready", tmp_path / "stop"
    replace_link(link, "step-1")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(link), str(ready), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(ready.exists, "the reader to start")
        for i in range(500):
            replace_link(link, f"step-{i % 2 + 1}")
    finally:
        stop.touch()
        out, _ = reader.communicate()
    seen = json.loads(out)
    assert set(seen) == {"step-1", "step-2"}, (
        seen
    )  # no "missing"; and both seen: it read while links changed


REPLACE = (
    "import sys; from pathlib import Path; from pipeline.files.atomic import replace_link; "
    "replace_link(Path(sys.argv[1]), 'step-2')"
)


def test_a_kill_inside_a_link_replacement_leaves_the_old_link(tmp_path):
    """SIGKILL at the kill point inside replace_link (PIPELINE_CHAOS, a real process): the link still names its
    old target; the next replacement (and a save's clean-up of temporaries) finishes the job."""
    link, trace = tmp_path / "best", tmp_path / "trace.txt"
    replace_link(link, "step-1")
    env = {**env_for_subprocess(), "PIPELINE_CHAOS": "save:1", "PIPELINE_CHAOS_TRACE": str(trace)}
    proc = subprocess.run(
        [sys.executable, "-c", REPLACE, str(link)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert trace.read_text() == "save 1 before a link's rename\n"
    assert os.readlink(link) == "step-1"
    replace_link(link, "step-2")
    remove_temporaries(tmp_path)
    assert os.readlink(link) == "step-2" and sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "trace.txt",
    ]


def step_dir(path) -> dict:
    """A step directory of three files at `path`; returns each file's sha256 by name."""
    import hashlib

    path.mkdir(parents=True)
    for name, data in (
        ("weights.safetensors", b"w" * 3000),
        ("manifest.json", b"{}"),
        ("extra.json", b"[]"),
    ):
        (path / name).write_bytes(data)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


def same(path, found: dict) -> bool:
    import hashlib

    return (
        os.path.isdir(path)
        and {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()} == found
    )


def test_a_move_across_filesystems_copies_durably_before_the_original_goes(
    tmp_path, syscalls, monkeypatch
):
    """superseded/ on another filesystem: the step directory is copied whole (every file fsynced, then the
    directory, renamed into place, the parent fsynced), and only then is the original removed; at every
    instant one of the two is whole."""
    from conftest import cross_device

    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.files.atomic import move

    src, dst = tmp_path / "checkpoints" / "step-00000021", tmp_path / "superseded" / "step-00000021"
    found = step_dir(src)
    dst.parent.mkdir()

    def whole() -> bool:
        """the step directory is whole where it was or where it goes"""
        return same(src, found) or same(dst, found)

    cross_device(monkeypatch, dst.parent)
    syscalls.invariant = whole
    move(src, dst, copy=lambda step, to: CheckpointDir(step).second_names(to))
    assert not os.path.lexists(src) and same(dst, found)
    parent_synced = assert_saved_in_durable_order(syscalls, dst)
    removed = next(
        i
        for i, e in enumerate(syscalls.events)
        if e[0] in ("rename", "remove") and e[1] == os.path.realpath(src)
    )
    assert parent_synced < removed, syscalls.events
    assert os.listdir(dst.parent) == [dst.name]  # no temporary left
    file = tmp_path / "metrics.jsonl"
    file.write_bytes(b"{}\n")
    move(file, tmp_path / "superseded" / file.name)  # a file: its bytes, fsynced
    assert (
        not os.path.lexists(file) and (tmp_path / "superseded" / file.name).read_bytes() == b"{}\n"
    )


def test_a_move_across_filesystems_that_fails_midway_leaves_the_original_as_it_was(
    tmp_path, monkeypatch
):
    from conftest import cross_device

    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.files.atomic import move

    src, dst = tmp_path / "checkpoints" / "step-00000006", tmp_path / "superseded" / "step-00000006"
    found = step_dir(src)
    dst.parent.mkdir()
    cross_device(monkeypatch, dst.parent)
    written = []
    real = atomic.write_new

    def full(path, data, *args, **kwargs):  # the disk fills up at the second file
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(path)
        return real(path, data, *args, **kwargs)

    monkeypatch.setattr(atomic, "write_new", full)
    with pytest.raises(OSError, match="No space left on device") as caught:
        move(src, dst, copy=lambda step, to: CheckpointDir(step).second_names(to))
    assert caught.value.errno == errno.ENOSPC
    assert same(src, found) and os.listdir(dst.parent) == []  # as it was; the half copy gone


@pytest.mark.parametrize("planted", ["directory", "link", "fifo"])
def test_a_move_across_filesystems_refuses_what_it_would_not_copy_whole(
    tmp_path, monkeypatch, planted
):
    # the step directory's own files are copied; anything else in it would be lost with the original: refused
    from conftest import cross_device

    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.files.atomic import move

    src, dst = tmp_path / "checkpoints" / "step-00000006", tmp_path / "superseded" / "step-00000006"
    step_dir(src)
    {
        "directory": lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")),
        "link": lambda p: p.symlink_to("weights.safetensors"),
        "fifo": os.mkfifo,
    }[planted](src / "planted")
    found = {p.relative_to(src): (p.is_symlink(), p.is_dir()) for p in src.rglob("*")}
    dst.parent.mkdir()
    cross_device(monkeypatch, dst.parent)
    with pytest.raises(
        OSError, match=r"another filesystem and 'planted.*' of .* would not be copied whole"
    ):
        move(src, dst, copy=lambda step, to: CheckpointDir(step).second_names(to))
    assert {p.relative_to(src): (p.is_symlink(), p.is_dir()) for p in src.rglob("*")} == found
    assert os.listdir(dst.parent) == []
