"""Opening a file to read: a regular file only (no link unless followed on purpose), never blocking, bounded."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat

from pipeline.files.atomic import UnsafePathError, write_new

CHUNK = 1 << 20  # bytes per read while hashing or reading whole
LINKED = "is a symlink, not a regular file"

KINDS = (
    (stat.S_ISREG, "a regular file", 0),
    (stat.S_ISDIR, "a directory", errno.EISDIR),
    (stat.S_ISFIFO, "a FIFO", errno.EINVAL),
    (stat.S_ISCHR, "a character device", errno.EINVAL),
    (stat.S_ISBLK, "a block device", errno.EINVAL),
    (stat.S_ISSOCK, "a socket", errno.EINVAL),
    (stat.S_ISLNK, "a symlink", errno.ELOOP),
)


class UnreadableFile(UnsafePathError):
    """Not a regular file, or over the reader's bound: refused like a planted link; str() is "<path>: <reason>"."""


def kind_of(st: os.stat_result) -> str:
    """'a FIFO', 'a character device', ... for what an lstat/fstat describes ('a regular file' included)."""
    return next((name for test, name, _ in KINDS if test(st.st_mode)), "not a regular file")


def _refuse(path, st: os.stat_result, limit: int | None, bound: str | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        code = next((c for test, _, c in KINDS if test(st.st_mode)), errno.EINVAL)
        raise UnreadableFile(code, f"is {kind_of(st)}, not a regular file", os.fspath(path))
    if limit is not None and st.st_size > limit:
        why = f"{st.st_size} bytes, over the {limit}-byte limit" + _hint(bound)
        raise UnreadableFile(errno.EFBIG, why, os.fspath(path))


def _hint(bound: str | None) -> str:
    return f" set by {bound} (raise it to read a bigger file)" if bound else ""


def open_file(path, limit: int | None = None, follow=False, bound: str | None = None) -> io.FileIO:
    """`path`, unbuffered, if a regular file of at most `limit` bytes; else UnreadableFile (`bound`: the setting).
    A FIFO (open blocks) or a device (never ends) is refused by the stat, then again on the O_NONBLOCK descriptor."""
    _refuse(path, os.stat(path, follow_symlinks=follow), limit, bound)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    flags |= 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:  # a link swapped in since the lstat
            raise UnreadableFile(errno.ELOOP, LINKED, os.fspath(path)) from None
        raise
    try:
        _refuse(path, os.fstat(fd), limit, bound)  # whatever was swapped in since the stat
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def chunks(f: io.RawIOBase, path, limit: int | None = None, bound: str | None = None, size=CHUNK):
    """The bytes of an open file in pieces of at most `size`, refusing (UnreadableFile) past `limit`."""
    total = 0
    while piece := f.read(size if limit is None else min(size, limit + 1 - total)):
        total += len(piece)
        if limit is not None and total > limit:
            why = f"grew past the {limit}-byte limit while being read" + _hint(bound)
            raise UnreadableFile(errno.EFBIG, why, os.fspath(path))
        yield piece


def read_bytes(path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (checked before reading: a huge file costs nothing)."""
    with open_file(path, limit) as f:
        return b"".join(chunks(f, path, limit))


def sha256(path, limit: int | None = None, follow=False, bound=None, into=None) -> str:
    """sha256 hex of a regular file's bytes, read in pieces (or kept whole in `into`, a bytearray of its size)."""
    h, at = hashlib.sha256(), 0
    with open_file(path, limit, follow, bound) as f:
        for piece in chunks(f, path, limit, bound):
            h.update(piece)
            if into is not None:
                into[at : at + len(piece)] = piece
                at += len(piece)
    return h.hexdigest()


def copy_new(src, dest, limit: int, follow: bool = False) -> dict:
    """src's bytes (bounded) into a file created now at dest, fsynced, hashed as they are copied: {"size", "sha256"}."""
    with open_file(src, limit, follow=follow) as f:
        return write_new(dest, chunks(f, src, limit))
