"""A run directory: what it holds (docs/outputs.md), its lock, and its run.json and metrics.jsonl."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import io
import itertools
import os
import time
from pathlib import Path

from pipeline.checkpoint.errors import RunFileError
from pipeline.checkpoint.store import CheckpointStore
from pipeline.config.errors import CommandError
from pipeline.data.corpus import find_corpus
from pipeline.files import atomic, jsonio, reading
from pipeline.files.atomic import UnsafePathError, named, refuse_link
from pipeline.files.limits import MAX_METRICS, MAX_METRICS_LINE, MAX_RUN_JSON

# A holder that is not a job (the tracking agent linking run.json, reindex) keeps the lock for milliseconds:
# a job arriving then waits this long before it calls the directory busy.
LOCK_GRACE = 2.0  # seconds


class RunBusyError(CommandError):
    """Another process holds the run directory."""


def _lock_within(fd: int, grace: float, kind: int = fcntl.LOCK_EX) -> bool:
    """Take the lock, trying again for `grace` seconds; False if it stayed held."""
    deadline = time.monotonic() + grace
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


class RunDir:
    """A run directory, the only code that knows what it holds (docs/outputs.md)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path / ".lock"
        self.status_path = self.path / "run.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.log_path = self.path / "pipeline.log"
        self.hydra_dir = self.path / ".hydra"
        self.overrides_path = self.hydra_dir / "overrides.yaml"
        self.checkpoints = self.path / "checkpoints"
        self._fd: int | None = None
        self.read_only = False  # a read-only medium: a complete run is confirmed, nothing written
        self.created = False  # acquire() made it: forget() removes it while it holds nothing

    @functools.cached_property
    def store(self) -> CheckpointStore:
        """Its checkpoints/ (a new store once a history moves aside)."""
        return CheckpointStore(self.checkpoints)

    @classmethod
    def of_checkpoint(cls, directory: Path) -> RunDir | None:
        """The run whose store `directory` lies in (RUN/checkpoints/step-NNNNNNNN, RUN/checkpoints/best), else None."""
        run = cls(Path(directory).parent.parent)
        return run if run.store.root == Path(directory).parent else None

    @property
    def output_dir(self) -> Path | None:
        """The output directory it lies in (<output_dir>/runs/<run>), else None."""
        return self.path.parent.parent if self.path.parent.name == "runs" else None

    def corpus(self, manifest_hash: str) -> Path | None:
        """The corpus it was trained on (by its MANIFEST.json's hash) in its output directory's corpus cache."""
        out = self.output_dir
        return None if out is None else find_corpus(out / "data", manifest_hash)

    def is_run(self) -> bool:
        """Whether it holds a run: its store of checkpoints or its run.json."""
        return self.store.root.is_dir() or self.status_path.is_file()

    def records(self) -> list[tuple[str, Path, int]]:
        """(name, path, byte bound) of .hydra/'s files, run.json and metrics.jsonl; UnsafePathError for a link."""
        out = []
        if os.path.lexists(self.hydra_dir):
            refuse_link(self.hydra_dir, "directory")
            for e in sorted(os.scandir(self.hydra_dir), key=lambda e: e.name):
                refuse_link(Path(e.path))
                out.append((f"{self.hydra_dir.name}/{e.name}", Path(e.path), MAX_RUN_JSON))
        for p, limit in ((self.status_path, MAX_RUN_JSON), (self.metrics_path, MAX_METRICS)):
            out += [(p.name, p, limit)] if os.path.lexists(p) else []
        return out

    def acquire(self) -> None:
        """Create the directory if needed and take its lock; RunBusyError if held, UnsafePathError for a link."""
        with contextlib.suppress(OSError):
            flag = os.statvfs(self.path).f_flag if os.path.isdir(self.path) else 0
            self.read_only = flag & os.ST_RDONLY != 0
        grace, kind = LOCK_GRACE, fcntl.LOCK_EX
        if self.read_only:  # no lock file is made; one there is held shared (refused while written)
            refuse_link(self.lock_path)
            try:
                fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            grace, kind = 0.0, fcntl.LOCK_SH
        else:
            self.created = not os.path.lexists(self.path)
            atomic.ensure_dirs(self.path.parent, self.path.name)
            for path in (self.lock_path, self.status_path, self.metrics_path, self.log_path):
                refuse_link(path, "file")
            for path in (self.hydra_dir, self.checkpoints, self.path / "superseded"):
                refuse_link(path, "directory")
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(self.lock_path, flags, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    said = f"{self.lock_path} is a symlink; remove it"
                    raise UnsafePathError(errno.ELOOP, said) from None
                raise
        if not _lock_within(fd, grace, kind):  # the holder named: a writer's lock file says its pid
            pid = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            holder = f" (pid {pid})" if kind == fcntl.LOCK_EX else ""
            said = f"is in use by another process{holder}; wait for it to finish or stop it first"
            raise RunBusyError(f"run directory {self.path} {said}")
        self._fd = fd

    def claim(self, config_yaml: str, overrides: list[str]):
        """Its pid into the lock, the config and overrides into .hydra/; its pipeline.log, open for appending."""
        assert self._fd is not None, "acquire() comes first"
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            self.forget()
            raise named(e, self.lock_path) from e
        atomic.ensure_dirs(self.path, ".hydra")
        atomic.replace_file(self.hydra_dir / "config.yaml", config_yaml.encode())
        listed = "".join(f"- {jsonio.dumps_line(o)}\n" for o in overrides)
        atomic.replace_file(self.overrides_path, listed.encode() or b"[]\n")
        return atomic.open_append(self.log_path)

    def forget(self) -> None:
        """Release; remove the directory if acquire() made it and it holds only an empty lock (a refused run's)."""
        self.release()
        with contextlib.suppress(OSError):
            alone = self.created and os.listdir(self.path) == [self.lock_path.name]
            if alone and os.path.getsize(self.lock_path) == 0:
                os.unlink(self.lock_path)
                os.rmdir(self.path)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def in_use(self) -> bool:
        """True if a live process holds the lock (reading never creates or changes anything)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return not _lock_within(fd, 0.0)  # a lock taken is released by the close
        finally:
            os.close(fd)

    def read_status(self) -> dict:
        """run.json ({} if there is none); RunFileError if it is damaged: not strict JSON, or not an object."""
        try:
            status = jsonio.loads(reading.read_bytes(self.status_path, MAX_RUN_JSON))
        except FileNotFoundError:
            return {}
        except (OSError, jsonio.JSONError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise RunFileError(self.path, self.status_path.name, why) from None
        if not isinstance(status, dict):
            raise RunFileError(self.path, self.status_path.name, "not a JSON object")
        return status

    def write_status(self, ending: bool = False, **fields) -> None:
        """run.json, atomically; on a disk too full for the temporary, an `ending` is rewritten inside run.json's
        own bytes, cut to fit and padded with spaces (not atomic: a torn run.json is refused as damaged)."""
        record = {**fields, "updated": time.time()}
        try:
            atomic.replace_file(self.status_path, jsonio.dumps(record))
            return
        except OSError as e:  # an ending still must not leave `running` behind
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            if not (ending and full and self.status_path.exists()):
                raise
        fd = os.open(self.status_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            room = os.fstat(fd).st_size
            data = jsonio.dumps(record)
            if len(data) > room:  # the fields that matter most, the reason cut to fit
                keys = ("status", "step", "error", "updated")
                record = {k: record[k] for k in keys if k in record}
                record["error"] = str(record.get("error", ""))[: max(0, room - 160)]
                data = jsonio.dumps(record)
            if len(data) > room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.status_path))
            os.pwrite(fd, data + b" " * (room - len(data)), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_metrics(self) -> list[dict]:
        """metrics.jsonl's lines; a torn last line is dropped, any other bad line is a RunFileError naming it."""
        damage = functools.partial(RunFileError, self.path, self.metrics_path.name)
        try:
            f = io.BufferedReader(reading.open_file(self.metrics_path, MAX_METRICS), reading.CHUNK)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise damage(e.strerror or str(e)) from None
        lines: list[dict] = []
        total = 0
        with f:  # line by line, each bounded: one planted 1 GB line costs MAX_METRICS_LINE, not gigabytes
            for number in itertools.count(1):
                text = f.readline(MAX_METRICS_LINE + 1)
                total += len(text)
                if total > MAX_METRICS:
                    raise damage(f"grew past the {MAX_METRICS}-byte limit")
                if len(text) > MAX_METRICS_LINE:
                    raise damage(f"line {number}: over the {MAX_METRICS_LINE}-byte limit of a line")
                if not text.endswith(b"\n"):
                    return lines  # b"" at the end, else the torn last line: dropped
                try:
                    line = jsonio.loads(text[:-1])
                except jsonio.JSONError as e:
                    raise damage(f"line {number}: {e}") from None
                if not isinstance(line, dict) or type(line.get("step")) is not int:
                    raise damage(f"line {number}: not an object with an integer step")
                lines.append(line)
        raise AssertionError("unreachable: the loop ends at the file's end")

    def keep_metrics(self, lines: list[dict]) -> None:
        """Replace metrics.jsonl by `lines` atomically (a resumed run appends from there)."""
        text = "".join(jsonio.dumps_line(ln) + "\n" for ln in lines)
        atomic.replace_file(self.metrics_path, text.encode())

    def open_metrics(self):
        return atomic.open_append(self.metrics_path)
