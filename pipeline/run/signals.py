"""SIGTERM, SIGINT, SIGUSR1/2 and SIGHUP, never a traceback: set-up raises `Interrupted` at once, training defers
(checkpoint, exit 75: docs/stages.md), a sweep's launcher passes them on; run_command is the one exit."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pipeline.config.errors import EXIT_PREEMPTED, Refusal, exit_code

log = logging.getLogger("pipeline")
MARKER = "interrupted"  # a stopped sweep's file in its directory: its jobs check it first
# USR1 is what `--signal=USR1@N` sends before a SLURM time limit, USR2 what submitit asks SLURM for; HUP what
# a closed terminal or a dropped ssh session sends (its default would end the process with -1, unsaved).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
RAISE, DEFER, SWEEP, DONE = "raise", "defer", "sweep", "done"


class Interrupted(BaseException):
    """A signal before the run held its directory (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def descendants(root: int) -> list[int]:
    """Pids of every process below `root` in its session (the tracking agent, in a session of its own, is no job)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    session = os.getsid(root)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):  # gone meanwhile
            if os.getsid(pid) == session:
                out.append(pid)
                todo.extend(children.get(pid, []))
    return out


def _take(handler, quiet: Callable[[BaseException | None], bool]) -> None:
    """Every one of SIGNALS to `handler`; sys.unraisablehook says nothing of an exception `quiet` is true of."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not quiet(unraisable.exc_value):
            previous(unraisable)

    sys.unraisablehook = hook
    for s in SIGNALS:
        signal.signal(s, handler)


class Signals:
    def __init__(self):
        self.received: int | None = None
        self.mode = RAISE
        self.installed = False
        self.marker: Path | None = None  # a sweep's MARKER file, which its jobs check first
        self.slurm_jobs: Path | None = None  # a SLURM sweep's submitit folder (its job ids)
        self.launching = None  # the sweep callback of the sweep this process launches: the entry ends or undoes it
        self.held = False  # a run has held its directory (deferring) in this process

    def install(self) -> None:
        """Take over the signals (main thread only; elsewhere, e.g. a worker thread, leave them be)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        previous, spec = sys.excepthook, getattr(sys.modules.get("__main__"), "__spec__", None)
        name = getattr(spec, "name", None) or "pipeline"  # what `python -m` runs, or the entry

        # a signal while an entry point's modules are still imported: one line
        def hook(kind, value, tb):
            if not isinstance(value, Interrupted):
                return previous(kind, value, tb)
            _interrupted(name.removesuffix(".__main__"), value.args[0], "nothing was written")
            sys.stderr.flush()
            self.finish()
            os._exit(EXIT_PREEMPTED)

        # first: a signal between two of the handlers below already ends in one line
        sys.excepthook = hook
        # the handler's raise landed in a callback Python runs for itself (a weakref's inside the
        # import system, a __del__): it cannot propagate; `received` holds the signal, acted on at the next check
        _take(self._handler, lambda e: isinstance(e, Interrupted))
        self.installed = True

    def _handler(self, signum, frame) -> None:
        if self.received is not None or self.mode == DONE:
            return  # already stopping, or the exit code is decided: a later signal changes nothing
        self.received = signum
        if self.mode == RAISE:
            raise Interrupted(signum)
        name = signal.Signals(signum).name
        if self.mode == DEFER:
            log.warning("received %s: finishing this update, then checkpointing", name)
            return
        log.warning("received %s: passing it to the sweep's running jobs; no new job starts", name)
        if self.marker is not None:
            with contextlib.suppress(OSError):
                self.marker.touch()
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        if self.slurm_jobs is not None:  # the jobs run on the cluster, not below this process
            from pipeline.run.slurm import signal_jobs

            args = (self.slurm_jobs, signum)
            threading.Thread(target=signal_jobs, args=args, daemon=True).start()

    def finish(self) -> None:
        """The exit code is decided: from now on the kernel ignores these signals (called last by entry points)."""
        self.mode = DONE
        if threading.current_thread() is not threading.main_thread():
            return
        # a signal caught just before SIG_IGN took over: nothing to say about it
        _take(signal.SIG_IGN, lambda e: isinstance(e, OSError) and "race condition" in str(e))

    @contextlib.contextmanager
    def deferring(self, held: bool = True):
        """A signal only sets the flag (in RAISE mode one that came is raised at once): while a run holds its
        directory (`held`), or in a step that must finish once begun, raised at its end (RAISE mode)."""
        previous, self.held = self.mode, self.held or held
        self.mode = DEFER if held or previous == RAISE else previous
        try:
            if previous == RAISE:
                self.check()
            yield self
        finally:
            self.mode = previous
        if previous == RAISE and not held:
            self.check()

    def check(self) -> None:
        """Raise the signal that came, if one did (set-up's check after a call that could not be cut short)."""
        if self.received is not None:
            raise Interrupted(self.received)

    def sweeping(self, sweep_dir: Path, slurm_jobs: Path | None = None, launcher=None) -> None:
        """The process that launches a sweep's jobs (`slurm_jobs`: a SLURM sweep's submitit folder), afresh."""
        self.install()
        self.marker, self.launching = Path(sweep_dir) / MARKER, launcher
        self.marker.unlink(missing_ok=True)
        self.mode, self.slurm_jobs = SWEEP, slurm_jobs

    def interrupted_start(self) -> bool:
        """A signal raised (RAISE mode) before any run held its directory, whatever a library made of it."""
        return self.received is not None and self.mode == RAISE and not self.held

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def sweep_interrupted(self, sweep_dir: str | Path | None) -> bool:
        """True if this sweep was interrupted: in this process, or (its marker file) in its launcher."""
        stopped_here = self.mode == SWEEP and self.received is not None
        return stopped_here or bool(sweep_dir and (Path(sweep_dir) / MARKER).exists())


# one per process: the entry point installs it before importing anything heavy
SIGNALS_STATE = Signals()


def command(name: str):
    """A main returning its exit code: an error that carries one is a line `<name>: <line>` on stderr."""

    def wrap(main: Callable[..., int | None]) -> Callable[..., int | None]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int | None:
            try:
                return main(*args, **kwargs)
            except (Exception, Refusal) as e:
                if SIGNALS_STATE.interrupted_start() or (known := exit_code(e)) is None:
                    raise  # a signal a library made another error of (run_command says it), or a bug
                print(f"{name}: {known[1]}", file=sys.stderr)
                return known[0]

        return run

    return wrap


def run_command(
    name: str, main: Callable[[], int | None] | str, interrupted: str = "nothing was written"
) -> NoReturn:
    """Every command's way in and out: run `main` (or a module's main(), its INTERRUPTED) as a `command`, exit with its
    code; a signal is `<name>: interrupted by SIGINT; <interrupted>`, EXIT_PREEMPTED."""
    try:
        SIGNALS_STATE.install()  # inside: a signal right after its handler is installed is already ours
        if isinstance(main, str):
            module = importlib.import_module(main)
            main, interrupted = module.main, getattr(module, "INTERRUPTED", interrupted)
        code = command(name)(main)()
    except (Interrupted, Exception, Refusal) as e:
        if not (isinstance(e, Interrupted) or SIGNALS_STATE.interrupted_start()):
            raise
        # an Interrupted, or one a library made another error of
        signame = e.args[0] if isinstance(e, Interrupted) else str(SIGNALS_STATE.name)
        code = _interrupted(name, signame, interrupted)
    finally:
        SIGNALS_STATE.finish()  # the code is decided: a later signal changes nothing
    exit_now(code)


def exit_now(code: int | None) -> NoReturn:
    """The process ends with `code`, the one exit of every command (and of a sweep's job SLURM requeues)."""
    if SIGNALS_STATE.mode != DONE:
        SIGNALS_STATE.finish()
    sys.exit(code)


def _interrupted(name: str, signame: str, what: str) -> int:
    print(f"{name}: interrupted by {signame}; {what}", file=sys.stderr)
    return EXIT_PREEMPTED
