"""The Hydra callback that makes a multirun one sweep (identity, directory, signals, parent run) and its end."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from hydra.core.override_parser.types import ChoiceSweep, RangeSweep
from hydra.experimental.callback import Callback
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.checkpoint.manifest import git_info
from pipeline.config import errors
from pipeline.config.identity import experiment_name, is_machine_key
from pipeline.config.targets import as_given, hydra_quoted, literal, parse_overrides
from pipeline.files import atomic, jsonio, names, reading
from pipeline.files.limits import MAX_SWEEP_JSON, MAX_SWEEP_RECORD
from pipeline.run.signals import SIGNALS_STATE
from pipeline.run.sweep import SweepJob
from pipeline.run.tracker import SweepParent
from pipeline.sweep.summary import best_job, read_jobs, shown_value, sweep_table, swept_values

log = logging.getLogger("pipeline")
STORE_WAIT = 0.5  # seconds the launcher gives the tracking store to say whether it can be written
# Sweeper settings that make no other sweep: where Optuna keeps its study, how many trials (more: the same study)
NOT_IDENTITY = ("storage", "study_name", "n_trials")
OPTUNA_DB = "optuna.db"
MAX_JOBS = 10_000  # a sweep's bound, counted before the sweeper expands its overrides (docs/tracking.md: Sweeps)


def _plain(node, resolve: bool = True):
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    except Exception:
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def swept(task_overrides: list[str], sweeper_params: dict | None) -> dict[str, str]:
    """{key: the values given} for every override that sweeps (a,b / range / interval / choice ...)."""
    sweeps = (o for o in parse_overrides(task_overrides) if o.is_sweep_override())
    out = {o.get_key_element().lstrip("+~"): o.input_line.split("=", 1)[1] for o in sweeps}
    return out | {str(k): str(v) for k, v in (sweeper_params or {}).items()}


def _record(directory) -> dict:
    """The sweep directory's sweep.json, {} if it does not read as an object."""
    try:
        sweep = jsonio.read(Path(directory) / "sweep.json", MAX_SWEEP_JSON)
    except (OSError, ValueError):
        return {}
    return sweep if isinstance(sweep, dict) else {}


def _stop(message: str, code: int = errors.EXIT_BAD_INPUT) -> None:
    """The sweep refused: Hydra makes a warning of a callback's Exception and goes on, not of a Refusal."""
    raise errors.Refusal(errors.CommandError(message, exit_code=code))


def job_count(task_overrides: list[str], sweeper: dict) -> int:
    """How many jobs a sweep asks for, unexpanded: n_trials, else the product of its sweep lengths (a glob: one)."""
    if isinstance(sweeper.get("n_trials"), int):
        return sweeper["n_trials"]
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    n = 1
    for o in parse_overrides([*task_overrides, *params]):
        v = o.value() if o.is_sweep_override() else None
        if isinstance(v, ChoiceSweep):
            n *= len(v.list)
        elif isinstance(v, RangeSweep) and v.step and v.start is not None and v.stop is not None:
            n *= max(0, math.ceil((v.stop - v.start) / v.step))
    return n


def job_name(overrides: list[str], keys) -> str:
    """A job's swept values as a person reads them: `optimizer.lr=0.003162 model.n_layer=2` (shown_value)."""
    picked = [f"{k}={shown_value(v)}" for k, v in swept_values(overrides, keys).items()]
    return " ".join(picked or (o for o in overrides if not _machine(o)))


def _machine(override: str) -> bool:
    return is_machine_key(override.split("=", 1)[0].lstrip("+~"))


def _slurm_jobs(launcher) -> Path | None:
    """Where submitit keeps a SLURM sweep's jobs, a folder per job id (`.submitit/%j`); None for other launchers."""
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return None
    prefix = str(launcher.get("submitit_folder") or "").split("%", 1)[0]
    return Path(prefix) if prefix.endswith("/") else Path(prefix).parent


def swept_monitor_inputs(keys) -> bool:
    """True if a swept key may change what check_monitors says from job to job (`experiment` may set anything)."""
    from pipeline.run.assemble import MONITOR_KEYS

    bare = {str(k).lstrip("+~") for k in keys}
    pairs = ((k, m) for k in bare for m in MONITOR_KEYS)
    under = (k == m or k.startswith((f"{m}.", f"{m}/")) or m.startswith(f"{k}.") for k, m in pairs)
    return "experiment" in bare or any(under)


def refuse_monitors(config: DictConfig, swept_keys) -> None:
    """A monitor every job shares naming no metric they log: exit 2 before the sweep writes anything."""
    from pipeline.run.assemble import MONITOR_KEYS, check_monitors

    if swept_monitor_inputs(swept_keys):
        return
    try:
        check_monitors({k.split(".")[0]: _plain(config.get(k.split(".")[0])) for k in MONITOR_KEYS})
    except errors.ConfigError as e:
        _stop(str(e))
    except Exception as e:
        log.debug("monitors not checked before the sweep: %s", e)


def parent_run(tracking) -> SweepParent:
    """The parent run, its tracker's `sweep_parent` (tracking=none: the no-op, nothing of tracking/ imported)."""
    node = _plain(tracking)
    if not isinstance(node, dict) or not node.get("_target_"):
        return SweepParent()
    try:
        tracker = get_class(str(node["_target_"]))
    except Exception as e:
        _stop(f"tracking._target_={node['_target_']}: {str(e).splitlines()[0]}")
    settings = {k: v for k, v in node.items() if not k.startswith("_")}
    return getattr(tracker, "sweep_parent", SweepParent)(**settings)


def job_of(hydra_cfg) -> SweepJob:
    """The job a multirun's task runs (no directory without a sweep callback; `unreadable`: a damaged sweep.json)."""
    ours = f"{__name__}.{SweepCallback.__name__}"
    callbacks = (hydra_cfg.get("callbacks") or {}).values()
    if not any(isinstance(c, (dict, DictConfig)) and c.get("_target_") == ours for c in callbacks):
        return SweepJob()
    directory, overrides = Path(str(hydra_cfg.sweep.dir)), as_given(hydra_cfg.overrides.task)
    path, num = directory / "sweep.json", int(hydra_cfg.job.get("num", 0))
    problem: str | None = None
    try:
        sweep = jsonio.read(path, MAX_SWEEP_JSON)
    except (reading.UnreadableFile, jsonio.JSONError) as e:
        problem = str(e)
    except OSError as e:
        problem = f"{path}: {e.strerror}"
    else:
        ok = isinstance(sweep, dict) and isinstance(sweep.get("id"), str)
        offset = sweep.get("job_offset") if ok else None
        if not (ok and isinstance(sweep.get("swept"), dict)):
            problem = f"{path}: not a sweep's record (an object with an id and what it sweeps)"
        elif offset is not None and not (type(offset) is int and 0 <= offset <= 10**9):
            problem = f"{path}: job_offset must be a non-negative integer (the trials its study held), got {offset!r}"
    if problem is not None:
        why = f"{problem}; the sweep's launcher writes it before any job: re-run the sweep"
        return SweepJob(dir=directory, overrides=overrides, num=num, unreadable=why)
    job = SweepJob(dir=directory, sweep_id=sweep["id"], overrides=overrides, started=time.time())
    job.num, job.name = num + int(sweep.get("job_offset") or 0), job_name(overrides, sweep["swept"])
    job.tracking_off = sweep.get("tracking_off")
    job.parent = {"sweep_id": sweep["id"]} if "uri" in sweep and not job.tracking_off else None
    job.parallel = not str(sweep.get("launcher", "")).endswith(".BasicLauncher")
    return job


class SweepCallback(Callback):
    def __init__(self) -> None:
        self.sweep: dict | None = None  # sweep.json's: id, dir, name, swept, uri, direction ...
        self.parent: SweepParent = SweepParent()  # the parent run, through the tracker's interface
        self.launcher_pid: int | None = None  # the process that started the sweep
        self.launched = False  # its parent run asked for, its line said
        self.indexed = False  # an index was asked for its parent run: it holds the first start
        # for the entry's undo (here only): the sweep directory, the directories made, the files as they were
        self.start: tuple[Path, atomic.NewDirs, dict] | None = None
        self.code: int | None = None  # the sweep's exit code, once it has ended

    def __getstate__(self) -> dict:
        return {**self.__dict__, "start": None}  # Hydra pickles this object to every job

    # --- the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        hydra = config.hydra
        task = as_given(hydra.overrides.task)
        sweeper = _plain(hydra.sweeper, resolve=False) or {}
        identity: dict = {"name": str(config.get("name", ""))}  # hashed with its keys sorted
        identity["overrides"] = sorted(o for o in task if not _machine(o))
        identity["sweeper"] = {k: v for k, v in sweeper.items() if k not in NOT_IDENTITY}
        if (why := names.problem(identity["name"] or "sweep")) is not None:
            _stop(f"name={names.shown(identity['name'])}: {why}")
        if (count := job_count(task, sweeper)) > MAX_JOBS:  # before anything is written or expanded
            why = f"this sweep asks for {count:,} jobs: at most {MAX_JOBS:,} in one multirun"
            _stop(f"{why} (split it, or sample it with a sweeper such as Optuna and its n_trials)")
        refuse_monitors(config, keys := swept(task, sweeper.get("params")))
        try:
            self._start(config, hydra, task, sweeper, identity, keys)
        except OSError as e:  # a link planted at sweeps/ (or elsewhere), a full disk
            if (said := errors.exit_code(e)) is None:
                raise
            _stop(said[1], said[0])

    def _start(self, config, hydra, task: list, sweeper: dict, identity: dict, keys: dict) -> None:
        sweep_id = hashlib.sha256(jsonio.dumps(identity, canonical=True)).hexdigest()[:12]
        output_dir = Path(str(config.paths.output_dir))
        atomic.check_output_dir(output_dir)  # before its files are read or anything is made
        named = f"{identity['name'] or 'sweep'}-{sweep_id}"
        target = Path(os.path.abspath(output_dir), "sweeps", named)
        # what the launcher writes before its first job, as it was (None: absent; a study, a file not read: kept)
        files: dict[str, bytes | None] = {}
        for name in ("sweep.json", "multirun.yaml", OPTUNA_DB):
            if not os.path.lexists(target / name):
                files[name] = None
            elif name != OPTUNA_DB:
                with contextlib.suppress(OSError):
                    files[name] = reading.read_bytes(target / name, MAX_SWEEP_RECORD)
        self.start = (target, atomic.NewDirs(target), files)
        self.parent = parent_run(config.get("tracking"))
        directory = atomic.ensure_dirs(output_dir, "sweeps", target.name)
        with open_dict(hydra):  # the launcher's and, composed again with this override, every job's
            hydra.sweep.dir = literal(str(directory))  # a `${` in the path stays text
            hydra.overrides.hydra.append(f"hydra.sweep.dir={hydra_quoted(literal(str(directory)))}")
        SIGNALS_STATE.sweeping(directory, slurm_jobs=_slurm_jobs(hydra.launcher), launcher=self)
        best_val = (_plain(config.get("stages")) or {}).get("best_val") or {}
        # best-val's mode (conf/stages/default.yaml); without that stage the jobs return NaN, either way round
        direction = "maximize" if best_val.get("mode") == "max" else "minimize"
        optuna = "optuna" in str(sweeper.get("_target_", ""))
        started = _record(directory).get("started")
        started = started if isinstance(started, (int, float)) else time.time()
        offset = _optuna_study(hydra, sweeper, directory, sweep_id, direction) if optuna else 0
        objective = f"best/{best_val['monitor']}" if best_val else None
        sweep = {"id": sweep_id, "dir": str(directory), "name": identity["name"], "swept": keys}
        sweep |= {"direction": direction, "objective": config.get("optimized_metric") or objective}
        sweep |= {"launcher": str(hydra.launcher.get("_target_", "")), "overrides": task}
        sweep |= {"sweeper": str(sweeper.get("_target_", "")), "started": started}
        sweep |= {"status": "running", "pid": os.getpid(), "host": socket.gethostname()}
        sweep |= {"git_sha": git_info().get("git_sha"), "job_offset": offset}
        # the parent's experiment, also for a sweep tracked by none (reindex puts the parent beside its children)
        parts = (OmegaConf.select(config, f"{g}._target_", default="") for g in ("model", "data"))
        sweep["experiment"] = experiment_name(identity["name"], *parts)
        self.sweep = sweep | self.parent.facts(timeout=STORE_WAIT)
        atomic.replace_file(directory / "sweep.json", jsonio.dumps(self.sweep))
        self.launcher_pid = os.getpid()
        # the basic launcher's parent run waits for its first job (a sweep Hydra refuses then leaves none, one line)
        if not self.sweep["launcher"].endswith(".BasicLauncher"):
            self.on_job_start(config)
        else:
            self.parent.warm(self.sweep)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        """The parent run asked for, its line said: once, in the launching process (by _start, or its first job)."""
        if self.sweep is not None and not self.launched and self.launcher_pid == os.getpid():
            self.launched = True
            self.indexed = self.parent.start(self.sweep)
            log.info("sweep %s: %s", self.sweep["id"], self.sweep["dir"])

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        """The table on stderr; `code`, the entry's exit: 0 if all completed, 75 if interrupted, else a failed job's."""
        if self.sweep is not None:
            self.code = end(self.sweep, None, self.parent)

    # --- the entry point, when the sweeper or Hydra raised in the launching process
    def raised(self, e: Exception, job_began: bool) -> int | None:
        """End this sweep after `e`, its code once its end is printed (refused before a job or signal: undone)."""
        self.code = None  # only an end said here makes a code of the exception
        with contextlib.suppress(OSError):
            if (message := atomic.environment_error(e)) is not None:
                self.end_unfinished(message)
            elif job_began or SIGNALS_STATE.received is not None or not self.discard_unlaunched():
                self.end_unfinished(f"{type(e).__name__}: {e}")
        return self.code

    def discard_unlaunched(self) -> bool:
        """Undo the start if no job ran; False if one did, its parent run was indexed (kept), or nothing to undo."""
        start, self.start = self.start, None
        if start is None or self.indexed:
            return False
        directory, made, files = start
        if (directory / "jobs").exists() and any((directory / "jobs").iterdir()):
            return False
        if directory in made.missing:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for name, data in files.items():
                if data is None:
                    (directory / name).unlink(missing_ok=True)
                else:
                    atomic.replace_file(directory / name, data)
        made.prune()
        return True

    def end_unfinished(self, error: str) -> bool:
        """End this sweep, its sweeper raised in its launching process, as at its end (`code`: 75 or a failed job's)."""
        if self.sweep is None:
            return False
        sweep, mine = _record(self.sweep["dir"]), (os.getpid(), socket.gethostname(), "running")
        if tuple(map(sweep.get, ("pid", "host", "status"))) != mine:
            return False
        # what its sweeper stumbled on (Optuna's best trial, when none completed): the table, failures, code
        if (code := end(sweep, error, self.parent, quiet=True)) is not None:
            self.code = code
        return True


def end(sweep: dict, error: str | None, parent: SweepParent, quiet: bool = False) -> int | None:
    """The sweep's outcome from its jobs' records, into sweep.json and its parent run; its table on stderr, then the
    exit line unless every job of this launch completed; the exit code (`quiet`: if all completed, None, unsaid)."""
    directory = Path(sweep["dir"])
    jobs = read_jobs(directory)
    # what this launch ran: only an Optuna study's new trials (from job_offset) say if a re-run has work left
    launched = {n: j for n, j in jobs.items() if n >= int(sweep.get("job_offset") or 0)}
    failed = {n: j for n, j in launched.items() if j.get("status") != "complete"}
    stopped = any(j.get("code") == errors.EXIT_PREEMPTED for j in launched.values())
    interrupted = SIGNALS_STATE.received is not None or stopped
    status = "interrupted" if interrupted else ("failed" if failed or error else "complete")
    sweep.update(status=status, ended_at=time.time(), error=error)
    atomic.replace_file(directory / "sweep.json", jsonio.dumps(sweep))
    table = sweep_table(sweep, jobs, best_job(jobs, sweep), parent.end(sweep))
    if quiet and not (interrupted or failed):
        return None
    say = functools.partial(print, file=sys.stderr)
    say(*table, sep="\n")
    of = f"of {len(jobs)} jobs"
    if interrupted:
        said = f"{len(failed)} {of} did not finish" if jobs else "no job ran"
        say(f"pipeline: the sweep was interrupted; {said}: re-run the same command to continue it")
        return errors.EXIT_PREEMPTED
    if not failed:
        return 0
    each = {n: (j.get("name", ""), j.get("error", j.get("status"))) for n, j in failed.items()}
    said = "; ".join(f"job {n} ({name}): {why}" for n, (name, why) in each.items())
    say(f"pipeline: {len(failed)} {of} failed: {said}")
    return min(int(j.get("code", 1)) for j in failed.values())


def _optuna_study(hydra, sweeper: dict, directory: Path, sweep_id: str, direction: str) -> int:
    """The Optuna sweeper at a study in the sweep directory (unless named), for the trials it lacks; how many it has."""
    url = f"sqlite:///{directory / OPTUNA_DB}"
    ours = {"_target_": "pipeline.sweep.optuna_storage.storage", "url": url}
    storage = sweeper.get("storage") or ours
    name = sweeper.get("study_name") or sweep_id
    done = held = 0
    if sweeper.get("storage") or (directory / OPTUNA_DB).exists():
        import optuna  # heavy: only for a sweep of Optuna's

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            study = optuna.load_study(study_name=name, storage=instantiate(storage))
            trials = study.get_trials(deepcopy=False)
        except KeyError:  # no such study in that storage yet
            trials = []
        held, done = len(trials), sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    given = ("hydra.sweeper.direction=", "++hydra.sweeper.direction=")
    with open_dict(hydra.sweeper):
        hydra.sweeper.storage, hydra.sweeper.study_name = storage, name
        # what the jobs return is best-val's best: minimise or maximise
        if not any(o.startswith(given) for o in as_given(hydra.overrides.hydra)):
            hydra.sweeper.direction = direction
        if isinstance(sweeper.get("n_trials"), int):
            hydra.sweeper.n_trials = max(0, sweeper["n_trials"] - done)
        # seeded as at the start, it would ask for the trials it began with again
        if held and type(seed := (sweeper.get("sampler") or {}).get("seed")) is int:
            hydra.sweeper.sampler.seed = seed + held
    return held
