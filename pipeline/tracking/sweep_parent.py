"""A sweep's parent run in mlflow, as its launcher drives it: the store checked, the agent asked to start and end it."""

from __future__ import annotations

import logging
import os

from pipeline.run.report import run_page, ui_command, ui_page, ui_server
from pipeline.run.tracker import SweepParent
from pipeline.tracking import common
from pipeline.tracking.link import Request, agent_for, request

log = logging.getLogger("pipeline")
LATER = "this process exits"
END_WAIT = 1.0  # seconds the launcher waits for its last messages to the agent to be on their way
OFF = "mlflow tracking (%s) is off for this sweep: %s. The jobs train and write their manifests; "
OFF += "index them later with `python -m pipeline.reindex`."
WAS_OFF = "mlflow tracking (%s) was off for this sweep: %s. The jobs trained and wrote their "
WAS_OFF += "manifests; index them with `python -m pipeline.reindex`."


class MlflowSweepParent(SweepParent):
    """A sweep's parent run, made and ended by the agent with the code reindex uses (pipeline/tracking/index.py)."""

    def __init__(self, uri: str, experiment: str, artifact_location: str | None = None, **_):
        self.uri, self.experiment = common.normalize_tracking_uri(str(uri)), str(experiment)
        self.artifact_location = common.artifact_root(self.uri, artifact_location)
        self.request: Request | None = None  # the agent's answer to parent_start (launcher only)

    def __getstate__(self) -> dict:  # Hydra pickles the callback, and this, to every job
        return {**self.__dict__, "request": None}

    def facts(self, timeout: float) -> dict:
        facts = {k: getattr(self, k) for k in ("uri", "experiment", "artifact_location")}
        if problem := common.store_problem(self.uri, timeout=timeout):
            facts["tracking_off"] = problem  # the jobs read it: said once, here
            log.warning(OFF, self.uri, problem)
        return facts

    def warm(self, sweep: dict) -> None:
        if not sweep.get("tracking_off"):
            agent_for(self.uri)  # mlflow's import, meanwhile: no request

    def start(self, sweep: dict) -> bool:
        if sweep.get("tracking_off"):
            return False
        link = agent_for(self.uri)  # at once: the agent starts beside the jobs
        where = {"uri": self.uri, "artifact_location": sweep.get("artifact_location")}
        where |= {"sweep_id": sweep["id"], "sweep_dir": sweep["dir"]}
        self.request = request(link, "parent_start", **where)
        return True

    def end(self, sweep: dict) -> list[str]:
        """Hand the parent's end to the agent (on SLURM, waiting up to SLURM_WAIT); the end table's lines on it."""
        if sweep.get("tracking_off"):
            return [f"not tracked: {sweep['tracking_off']}"]
        answer = self.request.event if self.request is not None else None
        link = agent_for(self.uri)
        parent = {"sweep_id": sweep["id"]}
        done = request(link, "sweep_end", uri=self.uri, sweep_dir=sweep["dir"], parent=parent)
        link.drain(END_WAIT)
        slurm = str(sweep.get("launcher")).endswith("SlurmLauncher")
        slurm = slurm or bool(os.environ.get("SLURM_JOB_ID"))
        ended = (done.event if done.done.wait(common.SLURM_WAIT) else None) if slurm else None
        if slurm and ended is not None and ended.get("event") == "finished":
            page = run_page(ended.get("uri") or "")
            log.info("mlflow: sweep parent run %s complete: %s", page, ended.get("status"))
        elif slurm:
            why = (ended or {}).get("message", f"no answer within {common.SLURM_WAIT:.0f} s")
            said = "mlflow: the tracking agent did not complete the sweep's parent run (%s); "
            log.warning(said + "`python -m pipeline.reindex` completes it", why)
        elif answer is None:
            log.info("mlflow: the tracking agent completes the sweep's parent run after %s", LATER)
        elif answer.get("event") != "ready":
            log.warning(WAS_OFF, self.uri, answer.get("message", "unknown error"))
        if answer is None:
            said = f"sweep.id={sweep['id']} in {self.uri} (the tracking agent completes it after {LATER})"
            return [said]
        if answer.get("event") != "ready":
            return [f"not tracked: {answer.get('message', 'unknown error')}"]
        # the experiment's runs view; a sqlite store has no server: say how to start one
        page = ui_page(ui_server(self.uri), answer["experiment_id"])
        runs = page if ui_server(self.uri) == self.uri else f"`{ui_command(self.uri)}`, then {page}"
        return [run_page(answer["uri"]), f"its runs: {runs}"]
