"""A Hydra callback making a multirun one parent mlflow run with a child run per job.

Configured under `hydra.callbacks` in conf/config.yaml for every run; it does nothing unless `tracking` is the
mlflow tracker (tracking=mlflow or tracking=server), and nothing at all in a single run.

- on_multirun_start (the launching process, before any job): starts the sweep's tracking agent
  (`pipeline.tracking.agent --listen <socket>`), which opens the store once -- a fresh sqlite DB is created
  and migrated here, so jobs never race its schema -- and creates the experiment and the parent run. The
  parent's coordinates and the agent's socket are plain attributes of this object, which Hydra pickles to
  every job (joblib workers, submitit jobs), so they reach the jobs wherever they run.
- on_job_start / on_job_end (each job's process): hands the parent to the job's tracker, which creates the
  child (tag mlflow.parentRunId) through the sweep's agent -- explicit run ids, never mlflow's process-global
  active run (joblib reuses worker processes) -- or through its own agent when the socket is out of reach
  (SLURM on another node). A job that fails before its tracker started (a bad config, data that does not fit)
  still gets a child run, ended FAILED with the error as a tag.
- on_multirun_end: the parent ends FINISHED, or FAILED if a child failed. A failing job makes Hydra re-raise
  in the launcher without calling on_multirun_end, so an atexit hook registered in on_multirun_start ends a
  parent still open when the launching process exits: FAILED (KILLED if the only trouble was preemption).
"""
from __future__ import annotations

import atexit
import logging
import os
import tempfile
import time
from pathlib import Path

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.tracking.common import (CURRENT_JOB, artifact_location_uri, is_mlflow_tracking,
                                      normalize_tracking_uri, params_of, tag_value)

log = logging.getLogger("pipeline")
START_TIMEOUT = 180.0  # seconds for the agent to import mlflow, create the DB and the parent run
END_TIMEOUT = 60.0
_LAUNCHER_LINK = None  # the launching process's link to the sweep agent (not picklable: not an attribute)


def _plain(node, resolve: bool = True):
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve: keep it as written
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        # {"uri", "experiment_id", "run_id", "agent": socket path}: plain data, pickled to the jobs
        self.parent: dict | None = None
        self.ended = False
        self.launcher_pid: int | None = None

    # --- the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _LAUNCHER_LINK
        tracking = config.get("tracking")
        if not is_mlflow_tracking(tracking):
            return
        from pipeline.checkpoint.manifest import git_info
        from pipeline.tracking.mlflow_tracker import _Link

        uri = normalize_tracking_uri(tracking.uri)
        hydra = config.hydra
        git = git_info()
        tags = {
            "mlflow.runName": f"sweep-{config.get('name', 'run')}-{time.strftime('%Y%m%d-%H%M%S')}",
            "mlflow.source.name": "pipeline -m",
            "sweep": "parent",
            "sweep.overrides": " ".join(hydra.overrides.task),
            "sweep.dir": str(hydra.sweep.dir),
            "sweep.launcher": str(hydra.launcher.get("_target_", "")),
            "sweep.sweeper": str(hydra.sweeper.get("_target_", "")),
            "experiment": str(config.get("name", "")),
            "git_sha": str(git.get("git_sha")),
        }
        if git.get("git_sha") not in (None, "unknown"):
            tags["mlflow.source.git.commit"] = git["git_sha"]
        socket_path = str(Path(tempfile.mkdtemp(prefix="pipeline-mlflow-")) / "agent.sock")
        try:
            link = _Link.spawn(listen=socket_path, priority=str(tracking.get("priority", 10)))
        except OSError as e:
            log.warning("mlflow: no parent run for this sweep (could not start the agent: %s)", e)
            return
        location = tracking.get("artifact_location")
        answer = link.request({"op": "parent_start", "uri": uri, "experiment": str(tracking.experiment),
                               "artifact_location": artifact_location_uri(location) if location else None,
                               "tags": {k: tag_value(v) for k, v in tags.items()}}, START_TIMEOUT)
        if not answer or answer.get("event") != "ready":
            why = answer.get("message") if answer else f"no answer within {START_TIMEOUT:.0f} s"
            log.warning("mlflow: no parent run for this sweep (%s); each job tracks on its own", why)
            link.close(timeout=0)
            return
        _LAUNCHER_LINK = link
        self.parent = {"uri": uri, "experiment_id": answer["experiment_id"], "run_id": answer["run_id"],
                       "agent": socket_path}
        self.launcher_pid = os.getpid()
        atexit.register(self._end_if_open)
        log.info("mlflow: sweep parent run %s", answer["uri"])

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._end(None)

    def _end_if_open(self) -> None:
        if os.getpid() == self.launcher_pid:
            self._end("the multirun stopped before its end (a job failed or the launcher was interrupted)")

    def _end(self, interrupted: str | None) -> None:
        global _LAUNCHER_LINK
        if self.parent is None or self.ended or _LAUNCHER_LINK is None:
            return
        self.ended = True
        parent = {k: v for k, v in self.parent.items() if k != "agent"}
        answer = _LAUNCHER_LINK.request({"op": "parent_end", "parent": parent, "interrupted": interrupted},
                                        END_TIMEOUT)
        if answer and answer.get("event") == "finished":
            log.info("mlflow: sweep parent run %s ended %s (%d children)", parent["run_id"], answer["status"],
                     answer["children"])
        else:
            log.warning("mlflow: could not end the sweep's parent run %s: %s", parent["run_id"],
                        (answer or {}).get("message", f"no answer within {END_TIMEOUT:.0f} s"))
        _LAUNCHER_LINK.close(timeout=30)
        _LAUNCHER_LINK = None

    # --- each job's process
    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        CURRENT_JOB.update(parent=self.parent, tracker=None)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        tracker = CURRENT_JOB.get("tracker")
        CURRENT_JOB.update(parent=None, tracker=None)
        if self.parent is None or job_return.status != JobStatus.FAILED:
            return
        if tracker is not None and getattr(tracker, "sid", None) is not None:
            return  # the job's own tracker has ended its child FAILED
        try:
            self._failed_child(config, job_return)
        except Exception as e:  # noqa: BLE001
            log.warning("mlflow: could not record the failed job in the sweep's parent run: %s", e)

    def _failed_child(self, config: DictConfig, job_return) -> None:
        """A child for a job that failed before its tracker started, ended FAILED (the same run if it exists)."""
        from pipeline.tracking.mlflow_tracker import link_for

        task = {k: _plain(config[k]) for k in config if k != "hydra"}
        try:
            from pipeline.identity import run_name

            run_dir = str((Path(task["paths"]["runs_dir"]) / run_name(task)).resolve())
        except Exception:  # noqa: BLE001
            run_dir = None
        error = job_return._return_value
        tags = {
            "mlflow.parentRunId": self.parent["run_id"],
            "mlflow.runName": Path(run_dir).name if run_dir else f"job-{config.hydra.job.get('num', '?')}",
            "mlflow.source.name": "pipeline",
            "experiment": str(task.get("name", "")),
            "error": tag_value(f"{type(error).__name__}: {error}"),
            "sweep.job_overrides": " ".join(config.hydra.overrides.task),
        }
        if run_dir:
            tags["run_dir"] = run_dir
        parent = {k: v for k, v in self.parent.items() if k != "agent"}
        answer = link_for(self.parent).request({"op": "failed_child", "parent": parent, "run_dir": run_dir,
                                                "params": params_of(task), "tags": tags}, END_TIMEOUT)
        if not answer or answer.get("event") != "finished":
            raise RuntimeError((answer or {}).get("message", f"no answer within {END_TIMEOUT:.0f} s"))
