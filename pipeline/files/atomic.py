"""Writes that never follow a planted link nor leave a torn file: O_EXCL temporaries, fsync, rename over."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from errno import EEXIST, ELOOP
from pathlib import Path

from pipeline.files import killpoint, names

TMP_PREFIX = ".tmp-"  # every reader ignores these; a directory's owner removes stale ones
# Failures of the machine, not of the job: one line naming the path, and what to do (exit EXIT_ERROR).
_FULL = "free space there (or set paths.output_dir elsewhere), then re-run the same command"
_LOCKED = "make it writable (or set paths.output_dir elsewhere), then re-run the same command"
ENVIRONMENT = {errno.ENOSPC: _FULL, errno.EDQUOT: _FULL, errno.EFBIG: _FULL}
ENVIRONMENT |= {errno.EROFS: _LOCKED, errno.EACCES: _LOCKED, errno.EPERM: _LOCKED}
ENVIRONMENT[errno.EIO] = "check the device, then re-run the same command"
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # renameat2's arguments (linux/fcntl.h, linux/fs.h)


class UnsafePathError(OSError):
    """Something other than what we would have created sits where we write (a symlink, a directory...)."""

    # one sentence for a person: "<path>: <reason>" or the reason naming it, no [Errno N]
    def __str__(self) -> str:
        if self.strerror is None:
            return super().__str__()
        return f"{self.filename}: {self.strerror}" if self.filename else self.strerror


def environment_error(e: BaseException) -> str | None:
    """One line for an OSError of the machine (a full disk, a read-only or forbidden place), else None."""
    if not isinstance(e, OSError) or isinstance(e, UnsafePathError) or e.errno not in ENVIRONMENT:
        return None
    where = f" {e.filename}" if e.filename else ""
    return f"cannot write{where}: {os.strerror(e.errno)} ({errno.errorcode[e.errno]}); {ENVIRONMENT[e.errno]}"


def named(e: OSError, path) -> OSError:
    """`e` naming `path` (os.write and fsync raise without a file name)."""
    if e.filename is None:
        e.filename = str(path)
    return e


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    return Path(path).with_name(f"{TMP_PREFIX}{Path(path).name}-{uuid.uuid4().hex[:12]}")


def write_new(path: Path, data, h=None, fsync: bool = True) -> dict:
    """Bytes or byte pieces into a file created now at `path`, hashed into `h` (else a new sha256), fsynced."""
    h, size = h or hashlib.sha256(), 0
    # created now: anything already there (a planted link included) is refused
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        why = f"{path} already exists; refusing to write through it"
        raise UnsafePathError(EEXIST, why) from None
    try:
        for piece in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
            h.update(piece)
            view = memoryview(piece).cast("B")  # os.write counts bytes
            size += len(view)
            while view:
                view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)  # while a hash on a helper thread catches up
    except OSError as e:
        raise named(e, path) from e
    finally:
        os.close(fd)
    return {"size": size, "sha256": h.hexdigest()}


def refuse_link(path: Path, what: str = "file") -> None:
    """Raise UnsafePathError if `path` exists as a symlink or is not a regular file/directory of the kind asked."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(ELOOP, f"{path} is a symlink; refusing to follow it (remove it)")
    want = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not want(st.st_mode):
        raise UnsafePathError(EEXIST, f"{path} is not a regular {what}; refusing to replace it")


def replace_file(path: Path, data: bytes) -> dict:
    """Replace (or create) a regular file atomically: readers see the old bytes or the new, never a mix."""
    path = Path(path)
    refuse_link(path)
    with temporary(temp_name(path), path) as tmp:
        entry = write_new(tmp, data)
        os.replace(tmp, path)
    fsync_dir(path.parent)
    return entry


@contextlib.contextmanager
def temporary(tmp: Path, final: Path):
    """`tmp`, removed if the block raises (a signal too); an OSError naming it (or in it) names `final` instead."""
    try:
        yield tmp
    except BaseException as e:
        remove_tree(tmp)
        if isinstance(e, OSError) and str(e.filename or "").startswith(str(tmp)):
            e.filename = str(final)  # the path the user knows, not its temporary
        raise


def open_append(path: Path):
    """A text file opened for appending, created if missing; a symlink at `path` is refused, not followed."""
    refuse_link(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    file = os.fdopen(fd, "a", encoding="utf-8")
    file.buffer.raw.name = str(path)  # type: ignore[attr-defined]  # not the fd's number: a failed write names the file
    return file


def ensure_dirs(root: Path, *parts: str) -> Path:
    """root/parts... as real directories, each part one name: nothing made outside `root` (alone may be a link)."""
    path = Path(root)
    for part in parts:
        if (why := names.problem(part, reserve=0)) is not None:
            why = f"{path}: a directory named {names.shown(part)} inside it {why}"
            raise UnsafePathError(errno.EINVAL, why)
    os.makedirs(path, exist_ok=True)
    for part in parts:
        path = path / part
        try:
            os.mkdir(path)
        except FileExistsError:
            refuse_link(path, "directory")
    return path


# What the pipeline makes in paths.output_dir (itself maybe a user's link): a link at one sends its writes elsewhere
OUTPUT_ENTRIES = ("mlflow.db", "mlartifacts", "data", "runs", "sweeps")


def check_output_dir(output_dir: Path) -> None:
    """UnsafePathError naming the first of OUTPUT_ENTRIES in `output_dir` that is a symlink (dangling or not)."""
    for entry in OUTPUT_ENTRIES:
        path = Path(output_dir) / entry
        if os.path.islink(path):
            target = names.shown(os.readlink(path))
            why = f"{path} is a symlink (to {target}); an output directory's own {entry} is never"
            why += " followed elsewhere: remove the link (or set paths.output_dir to where it"
            raise UnsafePathError(errno.ELOOP, why + " points)")


def new_temp_dir(parent: Path, name: str) -> Path:
    """An empty hidden directory beside where `name` will appear (same filesystem: the rename is atomic)."""
    tmp = temp_name(Path(parent) / name)
    os.mkdir(tmp)
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if (renameat2 := _renameat2()) is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _renameat2():
    """libc's renameat2, looked up once; None where this libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    return fn


def publish_dir(tmp: Path, final: Path, replace: bool = False) -> None:
    """The complete `tmp` renamed to `final`; replace=True swaps out one there in one step (else renames it aside
    first, then removes it): `final` is whole at every instant."""
    fsync_dir(tmp)
    doomed = None
    if os.path.lexists(final):
        refuse_link(final, "directory")
        if not replace:
            raise UnsafePathError(errno.EEXIST, f"{final} already exists")
        if _exchange(tmp, final):
            fsync_dir(final.parent)
            remove_tree(tmp)
            return
        doomed = temp_name(final)
        os.rename(final, doomed)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if doomed is not None:
        remove_tree(doomed)


def second_name(src: Path, dst: Path) -> None:
    """`dst` as another name of the file `src` (a hard link), else a fsynced copy; never through a link."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        with open(src, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fin:
            write_new(Path(dst), iter(lambda: fin.read(1 << 20), b""))


def move(src: Path, dst: Path, copy: Callable[[Path, Path], None] | None = None) -> None:
    """`src` renamed to the new `dst`; across filesystems (EXDEV, or EBUSY: `src` a mount point) `copy` (default
    second_name) makes a whole temporary beside `dst`, renamed in, and only then is `src` removed (or emptied)."""
    src, dst = Path(src), Path(dst)
    try:
        os.rename(src, dst)
        return
    except OSError as e:
        if not (e.errno == errno.EXDEV or (e.errno == errno.EBUSY and os.path.ismount(src))):
            raise
    with temporary(temp_name(dst), dst) as tmp:
        (copy or second_name)(src, tmp)
        # a planted directory, link or FIFO the copy skips
        if missing := sorted(_entries(src) - _entries(tmp)):
            why = f"{dst.parent} is another filesystem and {missing[0][0]!r:.80} of {src} would"
            why += " not be copied whole; nothing moved (move it yourself, or keep superseded/ on"
            raise OSError(errno.EXDEV, why + " the run's filesystem)")
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    for gone in [src / name for name in os.listdir(src)] if os.path.ismount(src) else [src]:
        if os.path.isdir(gone) and not os.path.islink(gone):
            discard_dir(gone)
        else:
            os.unlink(gone)
            fsync_dir(gone.parent)


def _entries(root: Path) -> set[tuple[str, bool]]:
    """(relative path, is a regular file) of everything under `root` (links not followed); a file: nothing."""
    walked = (os.path.join(top, n) for top, dirs, files in os.walk(root) for n in dirs + files)
    return {(os.path.relpath(p, root), stat.S_ISREG(os.lstat(p).st_mode)) for p in walked}


def discard_dir(directory: Path) -> None:
    """Remove a directory by renaming it to a temporary first: never half-deleted in plain sight."""
    refuse_link(directory, "directory")
    doomed = temp_name(directory)
    os.rename(directory, doomed)
    fsync_dir(directory.parent)
    remove_tree(doomed)


def replace_link(link: Path, target_name: str) -> None:
    """Point a relative symlink (e.g. checkpoints/best) at target_name atomically."""
    if os.path.lexists(link) and not os.path.islink(link):
        raise UnsafePathError(EEXIST, f"{link} exists and is not a link; refusing to replace it")
    tmp = temp_name(link)
    os.symlink(target_name, tmp)
    # killed here, the link still names its old target; renamed over it, a reader finds one target or the other
    killpoint.point("save", "before a link's rename")
    os.replace(tmp, link)
    fsync_dir(link.parent)


def remove_tree(path: Path) -> None:
    """Remove a file, link or directory tree without following links out of it."""
    with contextlib.suppress(FileNotFoundError):  # gone already
        if stat.S_ISDIR(os.lstat(path).st_mode):
            # fd-based on Linux: never follows a link inside
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def remove_temporaries(parent: Path, older_than: float | None = None) -> None:
    """Leftovers of dead writes: all (the caller holds `parent`'s lock), or those older than `older_than` seconds."""
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return
    now = time.time()
    for path in (Path(parent) / n for n in entries if n.startswith(TMP_PREFIX)):
        # its writer finished, or another cleaner got there first
        with contextlib.suppress(FileNotFoundError):
            if older_than is None or now - path.lstat().st_mtime > older_than:
                remove_tree(path)


class NewDirs:
    """The missing directories among `paths` (and parents); prune() removes those still empty: no tree left behind."""

    def __init__(self, *paths):
        self.missing: list[Path] = []
        for p in paths:
            p = Path(os.path.abspath(p))
            while not os.path.lexists(p) and p not in self.missing and p != p.parent:
                self.missing.append(p)
                p = p.parent

    def prune(self) -> None:
        for p in sorted(self.missing, key=lambda q: len(q.parts), reverse=True):
            if _empty_tree(p):
                shutil.rmtree(p, ignore_errors=True)


def _empty_tree(path: Path) -> bool:
    """A real directory holding only (real) directories that hold nothing else, however deep."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        for root, dirs, files in os.walk(path, followlinks=False):
            if files or any(os.path.islink(os.path.join(root, d)) for d in dirs):
                return False
    except OSError:
        return False
    return True
