"""A Hydra callback making a multirun one parent mlflow run with a child run per job.

Configured under `hydra.callbacks` in conf/config.yaml for every run; it does nothing unless `tracking` is the
mlflow tracker (tracking=mlflow or tracking=server), and nothing at all in a single run.

- on_multirun_start (the launching process, before any job): opens the store once -- a fresh sqlite DB is
  created and migrated here, so parallel jobs never race its schema -- and creates the experiment and the
  parent run. The parent's coordinates are plain attributes of this object, which Hydra pickles to every
  job (joblib workers, submitit/SLURM jobs), so they reach the jobs wherever they run.
- on_job_start / on_job_end (each job's process): hands the parent to the job's tracker, which creates the
  child (tag mlflow.parentRunId) with explicit run ids (MlflowClient, never mlflow's process-global active
  run: joblib reuses worker processes). A job that fails before its tracker started (a bad config, data
  that does not fit) still gets a child run, ended FAILED with the error as a tag.
- on_multirun_end: the parent ends FINISHED, or FAILED if a child failed. A failing job makes Hydra re-raise
  in the launcher without calling on_multirun_end, so an atexit hook registered in on_multirun_start ends a
  parent still open when the launching process exits: FAILED (KILLED if the only trouble was preemption).
"""
from __future__ import annotations

import atexit
import logging
import os
import time

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.tracking.common import (CURRENT_JOB, is_mlflow_tracking, normalize_tracking_uri, params_of,
                                      run_uri, tag_value)

log = logging.getLogger("pipeline")


def _plain(node, resolve: bool = True):
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve: keep it as written
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent: dict | None = None  # {"uri", "experiment_id", "run_id"}: plain data, pickled to the jobs
        self.ended = False
        self.launcher_pid: int | None = None

    # --- the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        tracking = config.get("tracking")
        if not is_mlflow_tracking(tracking):
            return
        try:
            from pipeline.checkpoint.facts import git_info
            from pipeline.config import PROJECT_ROOT
            from pipeline.tracking import store  # mlflow: imported once, in the launcher

            uri = normalize_tracking_uri(tracking.uri)
            client = store.open_client(uri)  # a fresh sqlite DB is created and migrated here, once
            experiment_id = store.ensure_experiment(client, str(tracking.experiment),
                                                    tracking.get("artifact_location"))
            hydra = config.hydra
            overrides = list(hydra.overrides.task)
            git = git_info(str(PROJECT_ROOT))
            tags = {
                "mlflow.runName": f"sweep-{config.get('name', 'run')}-{time.strftime('%Y%m%d-%H%M%S')}",
                "mlflow.source.name": "pipeline -m",
                "sweep": "parent",
                "sweep.overrides": " ".join(overrides),
                "sweep.dir": str(hydra.sweep.dir),
                "sweep.launcher": str(hydra.launcher.get("_target_", "")),
                "sweep.sweeper": str(hydra.sweeper.get("_target_", "")),
                "experiment": str(config.get("name", "")),
                "git_sha": str(git.get("git_sha")),
            }
            if git.get("git_sha") not in (None, "unknown"):
                tags["mlflow.source.git.commit"] = git["git_sha"]
            run = store.create_run(client, experiment_id, {k: tag_value(v) for k, v in tags.items()})
            self.parent = {"uri": uri, "experiment_id": experiment_id, "run_id": run.info.run_id}
            self.launcher_pid = os.getpid()
            atexit.register(self._end_if_open)
            log.info("mlflow: sweep parent run %s", run_uri(uri, experiment_id, run.info.run_id))
        except Exception as e:  # noqa: BLE001 - tracking never stops the sweep
            self.parent = None
            log.warning("mlflow: no parent run for this sweep (%s: %s); each job tracks on its own",
                        type(e).__name__, e)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._end(None)

    def _end_if_open(self) -> None:
        if os.getpid() == self.launcher_pid:
            self._end("the multirun stopped before its end (a job failed or the launcher was interrupted)")

    def _end(self, interrupted: str | None) -> None:
        if self.parent is None or self.ended:
            return
        self.ended = True
        try:
            from pipeline.tracking import store

            client = store.open_client(self.parent["uri"])
            children = client.search_runs([self.parent["experiment_id"]],
                                          f"tags.mlflow.parentRunId = '{self.parent['run_id']}'", max_results=10000)
            statuses = [c.info.status for c in children]
            if "FAILED" in statuses:
                status = "FAILED"
            elif interrupted:
                status = "KILLED" if "KILLED" in statuses else "FAILED"
            else:
                status = "KILLED" if "KILLED" in statuses else "FINISHED"
            vals = [c.data.metrics["val/loss"] for c in children if "val/loss" in c.data.metrics]
            if vals:
                client.log_metric(self.parent["run_id"], "best/val/loss", min(vals))
            client.set_tag(self.parent["run_id"], "sweep.children", str(len(children)))
            if interrupted:
                client.set_tag(self.parent["run_id"], "ended", interrupted)
            client.set_terminated(self.parent["run_id"], status=status, end_time=int(time.time() * 1000))
            log.info("mlflow: sweep parent run %s ended %s (%d children)", self.parent["run_id"], status,
                     len(children))
        except Exception as e:  # noqa: BLE001
            log.warning("mlflow: could not end the sweep's parent run %s: %s", self.parent["run_id"], e)

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
        from pathlib import Path

        from pipeline.tracking import store

        task = {k: _plain(config[k]) for k in config if k != "hydra"}
        try:
            from pipeline.app import run_dir_for

            run_dir = str(run_dir_for(task).resolve())
        except Exception:  # noqa: BLE001
            run_dir = None
        error = job_return._return_value
        client = store.open_client(self.parent["uri"])
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
        run = store.find_run(client, run_dir) if run_dir else None
        if run is None:
            run = store.create_run(client, self.parent["experiment_id"], tags)
        else:
            store.sync_tags(client, run, tags)
        store.sync_params(client, run, params_of(task))
        client.set_terminated(run.info.run_id, status="FAILED", end_time=int(time.time() * 1000))
