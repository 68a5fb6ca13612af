"""The Hydra callback that makes a multirun one sweep (identity, directory, signals, parent run) and its end."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.files import jsonio, names, reading
from pipeline.files.atomic import (NewDirs, UnsafePathError, check_output_dir, ensure_dirs, environment_error,
                                   replace_file)
from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED, CommandError, ConfigError, Refusal
from pipeline.config.targets import parse_overrides
from pipeline.run.signals import SIGNALS_STATE
from pipeline.run.sweep import SWEEP_DIR_ENV, SweepJob
from pipeline.tracking.common import (artifact_root, is_machine_key, is_mlflow_tracking, normalize_tracking_uri,
                                      store_problem)
from pipeline.tracking.summary import best_job, experiment_page, sweep_table

log = logging.getLogger("pipeline")
END_WAIT = 1.0  # seconds the launcher waits for its last messages to the tracking agent to be on their way
# Sweeper settings that do not make another sweep: where Optuna keeps the study (set here, in the sweep
# directory) and how many trials it should hold (a re-run with more continues the same study).
NOT_IDENTITY = ("storage", "study_name", "n_trials")
OPTUNA_DB = "optuna.db"
MAX_JOBS = 10_000  # a sweep's bound, counted before the sweeper expands its overrides (docs/tracking.md: Sweeps)


def _plain(node, resolve: bool = True):
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve yet: keep it as written
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def swept(task_overrides: list[str], sweeper_params: dict | None) -> dict[str, str]:
    """{key: the values given} for every override that sweeps (a,b / range / interval / choice ...)."""
    out = {}
    for o in parse_overrides(task_overrides):
        if o.is_sweep_override():
            out[o.get_key_element().lstrip("+~")] = o.input_line.split("=", 1)[1]
    out.update({str(k): str(v) for k, v in (sweeper_params or {}).items()})
    return out


def _stop(code: int, message: str) -> None:
    """The sweep refused: Hydra makes a warning of a callback's Exception and goes on, not of a Refusal."""
    raise Refusal(CommandError(message, exit_code=code))


def job_count(task_overrides: list[str], sweeper: dict) -> int:
    """How many jobs a sweep asks for, unexpanded: n_trials, else the product of its sweep lengths (a glob: one)."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if isinstance(sweeper.get("n_trials"), int):
        return sweeper["n_trials"]
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    n = 1
    for o in parse_overrides([*task_overrides, *params]):
        value = o.value() if o.is_sweep_override() else None
        if isinstance(value, ChoiceSweep):
            n *= len(value.list)
        elif isinstance(value, RangeSweep) and value.step:
            n *= max(0, math.ceil((value.stop - value.start) / value.step))
    return n


def job_name(overrides: list[str], keys) -> str:
    """The swept values of one job, as a person reads them: `optimizer.lr=0.003 model.n_layer=2`."""
    picked = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys]
    return " ".join(picked) or " ".join(o for o in overrides if not is_machine_key(o.split("=", 1)[0].lstrip("+~")))


def _slurm_jobs(launcher) -> Path | None:
    """Where submitit keeps a SLURM sweep's jobs, a folder per job id (`.submitit/%j`); None for other launchers."""
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return None
    folder = str(launcher.get("submitit_folder") or "")
    prefix = folder.split("%", 1)[0]
    return Path(prefix) if prefix.endswith("/") else Path(prefix).parent


def swept_monitor_inputs(keys) -> bool:
    """True if a swept key may change what check_monitors says from job to job (a group such as `experiment` may
    set anything)."""
    from pipeline.run.assemble import MONITOR_KEYS

    def related(k: str) -> bool:
        return k == "experiment" or any(k == m or k.startswith((f"{m}.", f"{m}/")) or m.startswith(f"{k}.")
                                        for m in MONITOR_KEYS)
    return any(related(str(k).lstrip("+~")) for k in keys)


def refuse_monitors(config: DictConfig, swept_keys) -> None:
    """A monitor or optimized_metric every job shares that names no metric the jobs log: one line and exit 2,
    before the sweep writes anything (one that a swept key may change is each job's own refusal, recorded)."""
    from pipeline.run.assemble import MONITOR_KEYS, check_monitors

    if swept_monitor_inputs(swept_keys):
        return
    try:
        plain = {k.split(".")[0]: _plain(config.get(k.split(".")[0])) for k in MONITOR_KEYS}
        check_monitors(plain)
    except ConfigError as e:
        _stop(EXIT_BAD_INPUT, str(e))
    except Exception as e:  # noqa: BLE001 - what cannot be judged here is judged by each job
        log.debug("monitors not checked before the sweep: %s", e)


@dataclass
class _Start:
    """What a sweep's start changed, to undo if no job ever runs: the directories it made, and the files of an
    existing sweep directory as they were (None: absent)."""
    directory: Path
    made: NewDirs
    files: dict


# The sweep this process started (its launcher), for the entry point: one per process, like SWEEP_DIR_ENV.
_started: list[_Start] = []


def parent_of(sweep: dict) -> dict | None:
    """How the jobs and the end name the sweep's parent run to the agent: by the sweep's id (None: untracked)."""
    return {"sweep_id": sweep["id"]} if "uri" in sweep and not sweep.get("tracking_off") else None


def job_of(hydra_cfg) -> SweepJob:
    """The job a multirun's task runs, from sweep.json and Hydra's job number and overrides; without a directory
    if there is no sweep callback, `unreadable` (bad input, one line) if sweep.json is not a sweep's record."""
    directory = os.environ.get(SWEEP_DIR_ENV)
    if not directory:
        return SweepJob()
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    path = Path(directory) / "sweep.json"
    try:
        sweep = jsonio.read(path, 1 << 24)
    except (OSError, jsonio.JSONError) as e:
        problem = str(e) if isinstance(e, (reading.UnreadableFile, jsonio.JSONError)) else f"{path}: {e.strerror}"
    else:
        ok = isinstance(sweep, dict) and isinstance(sweep.get("id"), str) and isinstance(sweep.get("swept"), dict)
        offset = sweep.get("job_offset") if ok else None
        problem = None if ok else f"{path}: not a sweep's record (an object with an id and what it sweeps)"
        if ok and offset is not None and not (type(offset) is int and 0 <= offset <= 10 ** 9):
            problem = f"{path}: job_offset must be a non-negative integer (the trials its study held), got {offset!r}"
    if problem is not None:
        return SweepJob(dir=Path(directory), overrides=overrides, num=int(hydra_cfg.job.get("num", 0)),
                        unreadable=f"{problem}; the sweep's launcher writes it before any job: re-run the sweep")
    return SweepJob(dir=Path(directory), sweep_id=sweep["id"], overrides=overrides,
                    num=int(hydra_cfg.job.get("num", 0)) + int(sweep.get("job_offset") or 0),
                    name=job_name(overrides, sweep["swept"]), parent=parent_of(sweep),
                    tracking_off=sweep.get("tracking_off"), started=time.time())


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.sweep: dict | None = None  # what sweep.json says: id, dir, name, swept, uri, direction, status ...
        self.parent_request = None  # the agent's answer to parent_start, in the launching process only
        self.launcher_pid: int | None = None  # the process that started the sweep
        self.launched = False  # its parent run asked for, its line said

    def __getstate__(self) -> dict:
        return {**self.__dict__, "parent_request": None}  # Hydra pickles this object to every job

    # --- the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        hydra = config.hydra
        task = [str(o) for o in hydra.overrides.task]
        sweeper = _plain(hydra.sweeper, resolve=False) or {}
        identity = {"name": str(config.get("name", "")), "overrides": sorted(o for o in task if not is_machine_key(
            o.split("=", 1)[0].lstrip("+~"))), "sweeper": {k: v for k, v in sweeper.items() if k not in NOT_IDENTITY}}
        if (why := names.problem(identity["name"] or "sweep")) is not None:  # <output_dir>/sweeps/<name>-<id>
            _stop(EXIT_BAD_INPUT, f"name={names.shown(identity['name'])}: {why}")
        if (count := job_count(task, sweeper)) > MAX_JOBS:  # before anything is written or expanded
            _stop(EXIT_BAD_INPUT, f"this sweep asks for {count:,} jobs: at most {MAX_JOBS:,} in one multirun "
                                  "(split it, or sample it with a sweeper such as Optuna and its n_trials)")
        refuse_monitors(config, swept(task, sweeper.get("params")))
        try:
            self._start(config, hydra, task, sweeper, identity)
        except UnsafePathError as e:  # a link planted at sweeps/ (or another of the output directory's entries)
            _stop(EXIT_BAD_INPUT, str(e))
        except OSError as e:
            if (message := environment_error(e)) is None:
                raise
            _stop(EXIT_ERROR, message)

    def _start(self, config: DictConfig, hydra, task: list[str], sweeper: dict, identity: dict) -> None:
        sweep_id = hashlib.sha256(jsonio.dumps(identity, canonical=True)).hexdigest()[:12]
        check_output_dir(Path(str(config.paths.output_dir)))  # before its files are read or anything is made
        target = Path(os.path.abspath(config.paths.output_dir), "sweeps", f"{identity['name'] or 'sweep'}-{sweep_id}")
        files = {n: b for n in START_FILES if (b := _bytes_of(target / n)) is not _UNREADABLE}
        _started[:] = [_Start(target, NewDirs(target), files)]
        directory = ensure_dirs(Path(str(config.paths.output_dir)), "sweeps",
                                f"{identity['name'] or 'sweep'}-{sweep_id}")
        os.environ[SWEEP_DIR_ENV] = str(directory)  # hydra.sweep.dir follows it, here and in every job
        SIGNALS_STATE.sweeping(directory, slurm_jobs=_slurm_jobs(hydra.launcher))
        best_val = (_plain(config.get("stages")) or {}).get("best_val") or {}
        direction = "maximize" if best_val.get("mode", "min") == "max" else "minimize"
        optuna = "optuna" in str(sweeper.get("_target_", ""))
        if optuna and not any(
                o.startswith(("hydra.sweeper.direction=", "++hydra.sweeper.direction=")) for o in hydra.overrides.hydra):
            with open_dict(hydra.sweeper):
                hydra.sweeper.direction = direction  # what the jobs return is best-val's best: minimise or maximise
        from pipeline.checkpoint.manifest import git_info

        try:
            previous = jsonio.read(directory / "sweep.json", 1 << 24)
        except (OSError, ValueError):
            previous = {}
        started = previous.get("started") if isinstance(previous.get("started"), (int, float)) else time.time()
        offset = _optuna_study(hydra, sweeper, directory, sweep_id) if optuna else 0
        self.sweep = {"id": sweep_id, "dir": str(directory), "name": identity["name"],
                      "swept": swept(task, sweeper.get("params")), "direction": direction,
                      "objective": str(config.get("optimized_metric") or f"best/{best_val.get('monitor', 'val/loss')}"),
                      "launcher": str(hydra.launcher.get("_target_", "")), "sweeper": str(sweeper.get("_target_", "")),
                      "overrides": task, "started": started, "status": "running", "pid": os.getpid(),
                      "host": socket.gethostname(), "git_sha": git_info().get("git_sha"), "job_offset": offset}
        tracking = config.get("tracking")
        if is_mlflow_tracking(tracking):
            uri = self.sweep["uri"] = normalize_tracking_uri(str(tracking.uri))
            self.sweep["experiment"] = str(tracking.experiment)
            location = tracking.get("artifact_location")  # a tracking server chooses its own: None
            self.sweep["artifact_location"] = artifact_root(uri, str(location) if location else None)
            if problem := store_problem(uri, timeout=END_WAIT / 2):
                self.sweep["tracking_off"] = problem  # the jobs read it: said once, here
                log.warning("mlflow tracking (%s) is off for this sweep: %s. The jobs train and write their "
                            "manifests; index them later with `python -m pipeline.reindex`.", uri, problem)
        replace_file(directory / "sweep.json", jsonio.dumps(self.sweep))
        self.launcher_pid = os.getpid()
        # Where the jobs run in this process, the parent run and the sweep's line wait for its first job (Hydra
        # composes them all first: a sweep refused then leaves no parent run and says one line); other
        # launchers' jobs need the parent at once.
        if not self.sweep["launcher"].endswith(".BasicLauncher"):
            self._launching()
        elif parent_of(self.sweep) is not None:
            from pipeline.tracking.link import agent_for, agent_log

            agent_for(self.sweep["uri"], agent_log(self.sweep["uri"]))  # warm meanwhile (mlflow's import): no request

    def _launching(self) -> None:
        self.launched = True
        if parent_of(self.sweep) is not None:
            self._start_parent()
        log.info("sweep %s: %s", self.sweep["id"], self.sweep["dir"])

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        if self.sweep is not None and not self.launched and self.launcher_pid == os.getpid():
            self._launching()

    def _start_parent(self) -> None:
        """Ask the agent for the parent run without waiting: the jobs name it by the sweep's id; the end reads it."""
        from pipeline.tracking.link import Request, agent_for, agent_log

        s = self.sweep
        link = agent_for(s["uri"], agent_log(s["uri"]))  # at once: the agent starts beside the jobs
        self.parent_request = Request()
        link.send({"op": "parent_start", "sid": link.register(self.parent_request), "uri": s["uri"],
                   "artifact_location": s.get("artifact_location"), "sweep_id": s["id"], "sweep_dir": s["dir"]})

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.sweep is not None:
            exit_for(end(self.sweep, None, self.parent_request))


START_FILES = ("sweep.json", "multirun.yaml", OPTUNA_DB)  # what a sweep's launcher writes before its first job


_UNREADABLE = object()  # a file an undo leaves as it is


def _bytes_of(path: Path):
    """A file's bytes as a sweep's start found them (an Optuna database: b"" for present), None if absent."""
    if not os.path.lexists(path):
        return None
    if path.name == OPTUNA_DB:
        return b""
    try:
        return reading.read_bytes(path, 1 << 26)
    except OSError:
        return _UNREADABLE


def discard_unlaunched() -> bool:
    """The entry point's undo of a sweep this process started whose jobs never ran (Hydra could not compose them,
    or the sweeper raised first): what its start wrote goes, the directories it made too (an earlier sweep's
    directory gets its files back), so that no sweep is left `running`; False if it had a job or there is none."""
    if not _started:
        return False
    start = _started.pop()
    jobs = start.directory / "jobs"
    if jobs.exists() and any(jobs.iterdir()):
        return False
    if start.directory in start.made.missing:
        shutil.rmtree(start.directory, ignore_errors=True)
    else:
        for name, data in start.files.items():
            path = start.directory / name
            if data is None:
                path.unlink(missing_ok=True)
            elif name != OPTUNA_DB:
                replace_file(path, data)
    start.made.prune()
    os.environ.pop(SWEEP_DIR_ENV, None)
    return True


def end_unfinished(error: str) -> bool:
    """The entry point's end of a sweep whose sweeper raised, if this process launched it and it has not ended."""
    directory = os.environ.get(SWEEP_DIR_ENV)
    try:
        sweep = jsonio.read(Path(directory) / "sweep.json", 1 << 24) if directory else {}
    except (OSError, ValueError):
        return False
    if (sweep.get("pid"), sweep.get("host"), sweep.get("status")) != (os.getpid(), socket.gethostname(), "running"):
        return False
    end(sweep, error)
    return True


def end(sweep: dict, error: str | None, parent_request=None) -> dict:
    """The sweep's outcome from its jobs' records, into sweep.json and its parent run (given parent_start's answer)."""
    directory = Path(sweep["dir"])
    jobs = read_jobs(directory)
    failed = {n: j for n, j in jobs.items() if j.get("status") != "complete"}
    interrupted = SIGNALS_STATE.received is not None or any(j.get("code") == EXIT_PREEMPTED for j in jobs.values())
    status = "interrupted" if interrupted else ("failed" if failed or error else "complete")
    sweep.update(status=status, ended_at=time.time(), error=error)
    replace_file(directory / "sweep.json", jsonio.dumps(sweep))
    answer = parent_request.event if parent_request is not None else None
    if parent_of(sweep) is not None:
        _end_parent(sweep, answer)
    table = sweep_table(sweep, jobs, best_job(jobs, sweep["direction"]), _where_parent(sweep, answer))
    return {"status": status, "failed": failed, "jobs": jobs, "table": table}


def exit_for(summary: dict) -> None:
    """The table on stderr; exit 0 only if every job completed: 75 if interrupted, else the first failure's code."""
    print(*summary["table"], sep="\n", file=sys.stderr)
    failed = summary["failed"]
    if summary["status"] == "interrupted":
        print(f"pipeline: the sweep was interrupted; {len(failed)} of {len(summary['jobs'])} jobs did not finish: "
              "re-run the same command to continue it", file=sys.stderr)
        raise SystemExit(EXIT_PREEMPTED)
    if failed:
        listing = "; ".join(f"job {n} ({j.get('name', '')}): {j.get('error', j.get('status'))}" for n, j in failed.items())
        print(f"pipeline: {len(failed)} of {len(summary['jobs'])} jobs failed: {listing}", file=sys.stderr)
        raise SystemExit(min(int(j.get("code", 1)) for j in failed.values()))


def _end_parent(sweep: dict, answer: dict | None) -> None:
    """Hand the parent's end to the agent, waiting at most END_WAIT for it to be on its way; a SLURM sweep (or a
    launcher inside a SLURM job, whose agent SLURM may end with it) waits up to SLURM_WAIT for the parent."""
    from pipeline.tracking.link import Request, agent_for
    from pipeline.tracking.mlflow_tracker import SLURM_WAIT, in_slurm_job

    link, done = agent_for(sweep["uri"]), Request()
    link.send({"op": "sweep_end", "sid": link.register(done), "uri": sweep["uri"], "sweep_dir": sweep["dir"],
               "parent": parent_of(sweep)})
    link.drain(END_WAIT)
    if not (str(sweep.get("launcher", "")).endswith("SlurmLauncher") or in_slurm_job()):
        _say_parent(sweep, answer)
        return
    ended = done.event if done.done.wait(SLURM_WAIT) else None
    if ended is not None and ended.get("event") == "finished":
        log.info("mlflow: sweep parent run %s complete: %s", ended.get("uri") or "", ended.get("status"))
    else:
        log.warning("mlflow: the tracking agent did not complete the sweep's parent run (%s); "
                    "`python -m pipeline.reindex` completes it", (ended or {}).get(
                        "message", f"no answer within {SLURM_WAIT:.0f} s"))


def _say_parent(sweep: dict, answer: dict | None) -> None:
    """The parent run's URI if the agent has answered by now; a warning if it failed (never a wait)."""
    if answer is None:
        log.info("mlflow: the tracking agent completes the sweep's parent run after this process exits")
    elif answer.get("event") == "ready":
        log.info("mlflow: sweep parent run %s%s", answer["uri"], " (continued)" if answer.get("reused") else "")
    else:
        log.warning("mlflow tracking (%s) was off for this sweep: %s. The jobs trained and wrote their manifests; "
                    "index them with `python -m pipeline.reindex`.", sweep["uri"],
                    answer.get("message", "unknown error"))


def _where_parent(sweep: dict, answer: dict | None) -> list[str]:
    """Where the sweep's parent run is, for its end table (the agent's answer, if it came), or why it is not."""
    if "uri" not in sweep:
        return ["not tracked (tracking=none)"]
    if sweep.get("tracking_off"):
        return [f"not tracked: {sweep['tracking_off']}"]
    if answer is None:
        return [f"sweep.id={sweep['id']} in {sweep['uri']} (the tracking agent completes it after this process "
                "exits)"]
    if answer.get("event") != "ready":
        return [f"not tracked: {answer.get('message', 'unknown error')}"]
    return [answer["uri"], f"its runs: {experiment_page(sweep['uri'], answer['experiment_id'])}"]


def _optuna_study(hydra, sweeper: dict, directory: Path, sweep_id: str) -> int:
    """Point the Optuna sweeper at a study in the sweep directory (unless the command names one), asking only for
    the trials it lacks; returns how many it holds: the first new trial's (and job's) number."""
    storage = sweeper.get("storage") or {"_target_": "pipeline.tracking.optuna_storage.storage",
                                         "url": f"sqlite:///{directory / OPTUNA_DB}"}
    name = sweeper.get("study_name") or sweep_id
    done = held = 0
    if sweeper.get("storage") or (directory / OPTUNA_DB).exists():
        import optuna
        from hydra.utils import instantiate

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            trials = optuna.load_study(study_name=name, storage=instantiate(storage)).get_trials(deepcopy=False)
        except KeyError:  # no such study in that storage yet
            trials = []
        held = len(trials)
        done = sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    with open_dict(hydra.sweeper):
        hydra.sweeper.storage, hydra.sweeper.study_name = storage, name
        if isinstance(sweeper.get("n_trials"), int):
            hydra.sweeper.n_trials = max(0, sweeper["n_trials"] - done)
    return held


def read_jobs(directory: Path) -> dict[int, dict]:
    """{num: record} of jobs/*.json; a damaged record is a report, not state: named in a warning, left out."""
    out = {}
    for p in sorted((Path(directory) / "jobs").glob("*.json")):
        try:
            record = jsonio.read(p, 1 << 20)
            out[int(record["num"])] = record
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("sweep job record %s left out: %s", p, str(e).removeprefix(f"{p}: ") or type(e).__name__)
    return out

