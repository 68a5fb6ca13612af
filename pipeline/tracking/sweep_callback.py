"""A Hydra callback that makes a multirun one sweep: a stable identity and directory, signals that reach
every job, failures that fail only their job, and (with mlflow tracking) one parent run with a child per job.

Configured under `hydra.callbacks` in conf/config.yaml; nothing happens in a single run.

- on_multirun_start (the launching process, before any job): the sweep's identity is the hash of its
  overrides (machine keys left out) and its sweeper's settings, so re-running the identical command is the
  same sweep: the same directory `<output_dir>/sweeps/<name>-<id>/` (multirun.yaml, the sweeper's results,
  sweep.json, jobs/<num>.json) and, with mlflow tracking, the same parent run. Signals are passed on to the
  running jobs from now on (pipeline/run/signals.py). The parent is created (or found) through the machine's
  tracking agent; its coordinates are plain attributes of this object, which Hydra pickles to every job.
  For the Optuna sweeper, the direction follows best-val's mode unless set on the command line.
- on_job_start / on_job_end (each job's process): the job learns its parent, its name (the swept values)
  and number; at its end it records itself in jobs/<num>.json (run directory, status, objective, error).
- on_multirun_end, or the entry point when the sweeper raised: sweep.json gets the outcome and the parent
  is completed from the sweep directory (pipeline/tracking/index.py, as `reindex` would): status (KILLED if
  interrupted, FAILED if a job failed), which jobs failed and why, the best child, multirun.yaml and the
  sweeper's results as artifacts. Neither end waits for mlflow: the agent does this after the launcher exits
  (on SLURM the end waits for it, bounded: the agent may be one a job started, which SLURM ends with it).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.files import jsonio
from pipeline.files.atomic import ensure_dirs, environment_error, replace_file
from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED
from pipeline.run.signals import SIGNALS_STATE
from pipeline.tracking.common import (CURRENT_JOB, artifact_root, is_machine_key, is_mlflow_tracking,
                                      normalize_tracking_uri, store_problem)

log = logging.getLogger("pipeline")
SWEEP_DIR_ENV = "PIPELINE_SWEEP_DIR"  # read by conf/config.yaml's hydra.sweep.dir, in the launcher and every job
END_WAIT = 1.0  # seconds the launcher waits for its last messages to the tracking agent to be on their way
ACTIVE: "MlflowSweepCallback | None" = None  # the launching process's sweep, for the entry point to finish
_PARENT_REQUEST = None  # the launcher's pending parent_start (not an attribute: jobs get a pickled copy)
# Sweeper settings that do not make another sweep: where Optuna keeps the study (set here, in the sweep
# directory) and how many trials it should hold (a re-run with more continues the same study).
NOT_IDENTITY = ("storage", "study_name", "n_trials")
OPTUNA_DB = "optuna.db"
MAX_JOBS = 10_000  # a sweep's bound, counted before the sweeper expands its overrides (README, Sweeps)


def _plain(node, resolve: bool = True):
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve yet: keep it as written
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def swept(task_overrides: list[str], sweeper_params: dict | None) -> dict[str, str]:
    """{key: the values given} for every override that sweeps (a,b / range / interval / choice ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = {}
    for o in OverridesParser.create().parse_overrides(task_overrides):
        if o.is_sweep_override():
            out[o.get_key_element().lstrip("+~")] = o.input_line.split("=", 1)[1]
    out.update({str(k): str(v) for k, v in (sweeper_params or {}).items()})
    return out


def _stop(code: int, message: str) -> None:
    """End the launching process in one line: Hydra turns a callback's exception into a warning and goes on,
    but lets SystemExit through."""
    import sys

    print(f"pipeline: {message}", file=sys.stderr)
    raise SystemExit(code)


def job_count(task_overrides: list[str], sweeper: dict) -> int:
    """How many jobs a sweep asks for, without expanding it: a sweeper's n_trials (Optuna), else the product
    of the sweep overrides' lengths (a glob of a group's options counts as one: a group has few)."""
    import math as m

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if isinstance(sweeper.get("n_trials"), int):
        return sweeper["n_trials"]
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    n = 1
    for o in OverridesParser.create().parse_overrides([*task_overrides, *params]):
        value = o.value() if o.is_sweep_override() else None
        if isinstance(value, ChoiceSweep):
            n *= len(value.list)
        elif isinstance(value, RangeSweep) and value.step:
            n *= max(0, m.ceil((value.stop - value.start) / value.step))
    return n


def job_name(overrides: list[str], keys) -> str:
    """The swept values of one job, as a person reads them: `optimizer.lr=0.003 model.n_layer=2`."""
    picked = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys]
    return " ".join(picked) or " ".join(o for o in overrides if not is_machine_key(o.split("=", 1)[0].lstrip("+~")))


def _slurm_jobs(launcher) -> Path | None:
    """Where submitit keeps a SLURM sweep's jobs, one folder per job id (`.submitit/%j` in the sweep
    directory by default); None for every other launcher."""
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return None
    folder = str(launcher.get("submitit_folder") or "")
    prefix = folder.split("%", 1)[0]
    return Path(prefix) if prefix.endswith("/") else Path(prefix).parent


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.sweep: dict | None = None  # id, dir, name, swept, uri, direction: plain data, pickled to the jobs
        self.parent: dict | None = None  # {"run_id", "experiment_id"} of the parent run
        self.disabled: str | None = None  # why tracking is off for this sweep (said once, here)
        self.launcher_pid: int | None = None
        self.slurm = False  # a SLURM sweep, or a launcher inside a SLURM job: its end waits for the parent
        self.ended = False
        self.summary: dict = {}

    # --- the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        hydra = config.hydra
        task = [str(o) for o in hydra.overrides.task]
        sweeper = _plain(hydra.sweeper, resolve=False) or {}
        identity = {"name": str(config.get("name", "")), "overrides": sorted(o for o in task if not is_machine_key(
            o.split("=", 1)[0].lstrip("+~"))), "sweeper": {k: v for k, v in sweeper.items() if k not in NOT_IDENTITY}}
        if (count := job_count(task, sweeper)) > MAX_JOBS:  # before anything is written or expanded
            _stop(EXIT_BAD_INPUT, f"this sweep asks for {count:,} jobs: at most {MAX_JOBS:,} in one multirun "
                                  "(split it, or sample it with a sweeper such as Optuna and its n_trials)")
        try:
            self._start(config, hydra, task, sweeper, identity)
        except OSError as e:
            if (message := environment_error(e)) is None:
                raise
            _stop(EXIT_ERROR, message)

    def _start(self, config: DictConfig, hydra, task: list[str], sweeper: dict, identity: dict) -> None:
        global ACTIVE
        sweep_id = hashlib.sha256(jsonio.dumps(identity, canonical=True)).hexdigest()[:12]
        output_dir = Path(str(config.paths.output_dir))
        directory = ensure_dirs(output_dir, "sweeps", f"{identity['name'] or 'sweep'}-{sweep_id}")
        os.environ[SWEEP_DIR_ENV] = str(directory)  # hydra.sweep.dir follows it, here and in every job
        SIGNALS_STATE.sweeping(directory, slurm_jobs=_slurm_jobs(hydra.launcher))
        from pipeline.tracking.mlflow_tracker import in_slurm_job

        self.slurm = _slurm_jobs(hydra.launcher) is not None or in_slurm_job()
        stages = _plain(config.get("stages")) or {}
        mode = (stages.get("best_val") or {}).get("mode", "min")
        direction = "maximize" if mode == "max" else "minimize"
        if "optuna" in str(sweeper.get("_target_", "")) and not any(
                o.startswith(("hydra.sweeper.direction=", "++hydra.sweeper.direction=")) for o in hydra.overrides.hydra):
            with open_dict(hydra.sweeper):
                hydra.sweeper.direction = direction  # what the jobs return is best-val's best: minimise or maximise
        from pipeline.checkpoint.manifest import git_info

        try:
            previous = jsonio.read(directory / "sweep.json", 1 << 24)
        except (OSError, ValueError):
            previous = {}
        started = previous.get("started") if isinstance(previous.get("started"), (int, float)) else time.time()
        offset = _optuna_study(hydra, sweeper, directory, sweep_id) if "optuna" in str(sweeper.get("_target_", "")) else 0
        self.sweep = {"id": sweep_id, "dir": str(directory), "name": identity["name"],
                      "swept": swept(task, sweeper.get("params")), "direction": direction,
                      "objective": str(config.get("optimized_metric") or f"best/{(stages.get('best_val') or {}).get('monitor', 'val/loss')}"),
                      "launcher": str(hydra.launcher.get("_target_", "")), "sweeper": str(sweeper.get("_target_", "")),
                      "overrides": task, "started": started, "status": "running", "pid": os.getpid(),
                      "host": socket.gethostname(), "git_sha": git_info().get("git_sha"), "job_offset": offset}
        self.launcher_pid = os.getpid()
        ACTIVE = self
        tracking = config.get("tracking")
        if is_mlflow_tracking(tracking):
            self.sweep["uri"] = normalize_tracking_uri(str(tracking.uri))
            self.sweep["experiment"] = str(tracking.experiment)
            location = tracking.get("artifact_location")  # a tracking server chooses its own: None
            self.sweep["artifact_location"] = artifact_root(self.sweep["uri"], str(location) if location else None)
        replace_file(directory / "sweep.json", jsonio.dumps(self.sweep))
        if "uri" in self.sweep:
            self._start_parent()
        log.info("sweep %s: %s", sweep_id, directory)

    def _start_parent(self) -> None:
        """Ask the agent for the parent run without waiting: jobs start at once and name their parent by the
        sweep's id (the agent answers in order); end() reads the answer."""
        global _PARENT_REQUEST
        from pipeline.tracking.link import Request, agent_for
        from pipeline.tracking.mlflow_tracker import agent_log

        s = self.sweep
        problem = store_problem(s["uri"], timeout=END_WAIT / 2)
        if problem:
            self.disabled = problem
            log.warning("mlflow tracking (%s) is off for this sweep: %s. The jobs train and write their manifests; "
                        "index them later with `python -m pipeline.reindex`.", s["uri"], problem)
            return
        link = agent_for(s["uri"], agent_log(s["uri"]))  # at once: the agent starts beside the jobs
        _PARENT_REQUEST = Request()
        link.send({"op": "parent_start", "sid": link.register(_PARENT_REQUEST), "uri": s["uri"],
                   "artifact_location": s.get("artifact_location"), "sweep_id": s["id"], "sweep_dir": s["dir"]})
        self.parent = {"sweep_id": s["id"]}

    def _say_parent(self) -> None:
        """The parent run's URI if the agent has answered by now; a warning if it failed (never a wait)."""
        answer = _PARENT_REQUEST.event if _PARENT_REQUEST is not None else None
        if answer is None:
            log.info("mlflow: the tracking agent completes the sweep's parent run after this process exits")
        elif answer.get("event") == "ready":
            log.info("mlflow: sweep parent run %s%s", answer["uri"], " (continued)" if answer.get("reused") else "")
        else:
            log.warning("mlflow tracking (%s) was off for this sweep: %s. The jobs trained and wrote their manifests; "
                        "index them with `python -m pipeline.reindex`.", self.sweep["uri"],
                        answer.get("message", "unknown error"))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self.end(None)

    def end(self, error: str | None) -> dict:
        """The sweep's outcome, recorded in sweep.json and its parent run; returns {"status", "failed"}."""
        if self.sweep is None or os.getpid() != self.launcher_pid:
            return {}
        if self.ended:
            return self.summary
        directory = Path(self.sweep["dir"])
        jobs = read_jobs(directory)
        failed = {n: j for n, j in jobs.items() if j.get("status") != "complete"}
        interrupted = SIGNALS_STATE.received is not None or any(j.get("code") == EXIT_PREEMPTED for j in jobs.values())
        status = "interrupted" if interrupted else ("failed" if failed or error else "complete")
        self.sweep.update(status=status, ended_at=time.time(), error=error)
        replace_file(directory / "sweep.json", jsonio.dumps(self.sweep))
        if self.parent is not None:
            self._end_parent(directory)
        from pipeline.tracking.summary import sweep_table

        table = sweep_table(self.sweep, jobs, best_job(jobs, self.sweep["direction"]), self._where_parent())
        self.ended, self.summary = True, {"status": status, "failed": failed, "jobs": jobs, "table": table}
        return self.summary

    def _end_parent(self, directory: Path) -> None:
        """Hand the parent's end to the agent, which completes it from the sweep directory (naming the parent
        by the sweep's id, as the jobs do); `python -m pipeline.reindex` if it cannot. Not waited for (at
        most END_WAIT for the message to be on its way), except on SLURM: there the agent may be one a job
        started, which SLURM ends with that job, and a SLURM sweep's launcher has waited for its jobs anyway;
        it waits at most SLURM_WAIT for the parent to be complete and says how it ended."""
        from pipeline.tracking.link import Request, agent_for
        from pipeline.tracking.mlflow_tracker import SLURM_WAIT

        link, done = agent_for(self.sweep["uri"]), Request()
        link.send({"op": "sweep_end", "sid": link.register(done), "uri": self.sweep["uri"],
                   "sweep_dir": str(directory), "parent": self.parent})
        link.drain(END_WAIT)
        if not self.slurm:
            self._say_parent()
            return
        answer = done.event if done.done.wait(SLURM_WAIT) else None
        if answer is not None and answer.get("event") == "finished":
            parent = (_PARENT_REQUEST.event or {}).get("uri") if _PARENT_REQUEST is not None else None
            log.info("mlflow: sweep parent run %s complete: %s", parent or "", answer.get("status"))
        else:
            log.warning("mlflow: the tracking agent did not complete the sweep's parent run (%s); "
                        "`python -m pipeline.reindex` completes it", (answer or {}).get(
                            "message", f"no answer within {SLURM_WAIT:.0f} s"))

    def _where_parent(self) -> list[str]:
        """Where the sweep's parent run is, for its end table: its URI and the experiment's page once the
        agent has answered, else how to find it; "not tracked" with tracking=none or off."""
        if "uri" not in self.sweep:
            return ["not tracked (tracking=none)"]
        if self.disabled:
            return [f"not tracked: {self.disabled}"]
        answer = _PARENT_REQUEST.event if _PARENT_REQUEST is not None else None
        if answer is None:
            return [f"sweep.id={self.sweep['id']} in {self.sweep['uri']} (the tracking agent completes it after "
                    "this process exits)"]
        if answer.get("event") != "ready":
            return [f"not tracked: {answer.get('message', 'unknown error')}"]
        from pipeline.tracking.summary import experiment_page

        return [answer["uri"], f"its runs: {experiment_page(self.sweep['uri'], answer['experiment_id'])}"]

    # --- each job's process
    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        overrides = [str(o) for o in config.hydra.overrides.task]
        num = int(config.hydra.job.get("num", 0)) + int((self.sweep or {}).get("job_offset") or 0)
        job = None
        if self.sweep is not None:
            job = {"sweep_id": self.sweep["id"], "num": num, "overrides": overrides,
                   "name": job_name(overrides, self.sweep["swept"])}
        CURRENT_JOB.clear()
        CURRENT_JOB.update(parent=self.parent, job=job, disabled=self.disabled, started=time.time(),
                           sweep_dir=self.sweep["dir"] if self.sweep else None)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        job = CURRENT_JOB.get("job")
        if self.sweep is None or job is None:
            return
        failure = CURRENT_JOB.get("failure")
        if job_return.status == JobStatus.FAILED and failure is None:
            error = job_return._return_value
            failure = {"code": 1, "error": f"{type(error).__name__}: {error}"[:2000]}
        value = job_return._return_value if job_return.status != JobStatus.FAILED else None
        record = {**job, "run_dir": CURRENT_JOB.get("run_dir"), "run_uri": CURRENT_JOB.get("run_uri"),
                  "started": CURRENT_JOB.get("started"), "ended_at": time.time(),
                  "objective": float(value) if isinstance(value, (int, float)) else None,
                  "status": "complete" if failure is None else ("preempted" if failure["code"] == EXIT_PREEMPTED else "failed"),
                  **(failure or {})}
        try:
            replace_file(ensure_dirs(Path(self.sweep["dir"]), "jobs") / f"{job['num']}.json", jsonio.dumps(record))
        except OSError as e:
            log.warning("could not record job %s in %s: %s", job["num"], self.sweep["dir"], e)
        CURRENT_JOB.clear()


def _optuna_study(hydra, sweeper: dict, directory: Path, sweep_id: str) -> int:
    """Point the Optuna sweeper at a study kept in the sweep directory (unless the command names its own), so
    the identical command continues it: `n_trials` is the study's total of completed trials, and the
    sweeper is asked only for the rest. Returns how many trials the study holds already: the first new
    trial's number, which becomes its job's number (Hydra counts each launch from 0)."""
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
    """{num: record} of a sweep's jobs/*.json; a damaged record (not strict JSON, no integer num) is a
    report, not state: named in a warning and left out."""
    out = {}
    for p in sorted((Path(directory) / "jobs").glob("*.json")):
        try:
            record = jsonio.read(p, 1 << 20)
            out[int(record["num"])] = record
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("sweep job record %s left out: %s", p, str(e).removeprefix(f"{p}: ") or type(e).__name__)
    return out


def best_job(jobs: dict[int, dict], direction: str) -> dict | None:
    scored = [j for j in jobs.values() if isinstance(j.get("objective"), (int, float))
              and math.isfinite(jsonio.number(j["objective"]))]
    if not scored:
        return None
    scored.sort(key=lambda j: j["num"])  # ties: the first job
    return (min if direction == "minimize" else max)(scored, key=lambda j: j["objective"])
