"""Inside a SLURM job the index is complete when the job's process exits: SLURM ends every process of a job
when the job ends, the tracking agent a job started among them; outside SLURM a job never waits, and
`python -m pipeline.reindex` completes what a killed agent left.

The agent is the real one made slow to start (PIPELINE_TRACKING_AGENT_DELAY, far longer than tracking.wait),
and it is killed the moment the job's process has exited, as SLURM's process tracking would kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, env_for_subprocess
from test_tracking_wait import check_complete, runs_of, slow_env, waits_in

from pipeline.run.directory import RunDir
from pipeline.tracking.link import socket_path

pytestmark = pytest.mark.slow
IN_SLURM = {
    "SLURM_JOB_ID": "4242",
    "PIPELINE_TRACKING_AGENT_DELAY": "5",
}  # no SLURM_JOB_PARTITION: no requeue


def agents_of(uri: str) -> list[int]:
    """The pids of the agents serving `uri` (their command line names its socket)."""
    needle = str(socket_path(uri)).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_agents(uri: str) -> list[int]:
    """SIGKILL every agent of `uri`, as SLURM kills a job's processes at its end."""
    pids = agents_of(uri)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def pipeline(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    cwd.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_a_job_inside_slurm_exits_with_its_run_complete_in_the_index(tmp_path):
    out, uri = tmp_path / "out", f"sqlite:///{tmp_path}/out/mlflow.db"
    env = {
        **slow_env(),
        **IN_SLURM,
    }  # slow (5 s) beyond tracking.wait, quick within the job's SLURM bound
    proc = pipeline(
        [*KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false"],
        tmp_path / "cwd",
        env,
    )
    killed = kill_agents(uri)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed, (
        "the job's agent had exited by itself"
    )  # it was there to be killed, as SLURM would
    run_dir = next((out / "runs").iterdir())
    client, runs = runs_of(uri)
    assert len(runs) == 1, "the job left before the agent had made its run, and the agent died"
    check_complete(
        client, runs[0], run_dir
    )  # the slow agent had completed it before the job's process exited
    log = RunDir(run_dir).log_path.read_text()
    ((waited, bound),) = waits_in(log)
    assert waited <= bound == 1.0 and "inside a SLURM job, which waits for it at its exit" in log


def test_a_sweep_inside_slurm_ends_with_its_parent_and_children_complete(tmp_path):
    out, uri = tmp_path / "out", f"sqlite:///{tmp_path}/out/mlflow.db"
    env = {**slow_env(), **IN_SLURM}  # a sweep launched inside a SLURM allocation
    proc = pipeline(
        [
            "-m",
            *KERNODECK[:1],
            f"paths.output_dir={out}",
            "trainer.progress_bar=false",
            "optimizer.lr=0.01,0.03",
        ],
        tmp_path / "cwd",
        env,
    )
    assert kill_agents(uri), "the sweep's agent had exited by itself"
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = runs_of(uri)
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    assert len(parents) == 1, (
        "the sweep left before the agent had made its parent, and the agent died"
    )
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.jobs"] == "2"
    children = {
        r.data.tags["run_dir"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    run_dirs = sorted((out / "runs").iterdir())
    assert sorted(children) == [str(d.resolve()) for d in run_dirs]
    for d in run_dirs:
        check_complete(client, children[str(d.resolve())], d)
    said = proc.stdout + proc.stderr
    assert "mlflow: sweep parent run" in said and "complete: FINISHED" in said, said[-3000:]


def test_outside_slurm_a_job_never_waits_and_reindex_completes_what_a_killed_agent_left(tmp_path):
    out, uri = tmp_path / "out", f"sqlite:///{tmp_path}/out/mlflow.db"
    proc = pipeline(
        [*KERNODECK[:1], f"paths.output_dir={out}", "trainer.progress_bar=false"],
        tmp_path / "cwd",
        {k: v for k, v in slow_env().items() if k != "SLURM_JOB_ID"},
    )
    assert kill_agents(uri), (
        "the job's agent had exited by itself"
    )  # still asleep (20 s): the job was not
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((out / "runs").iterdir())
    log = RunDir(run_dir).log_path.read_text()
    ((waited, bound),) = waits_in(log)
    assert waited <= bound == 1.0 and "inside a SLURM job" not in log
    assert (
        not (out / "mlflow.db").exists() or runs_of(uri)[1] == []
    )  # the agent died before indexing anything
    again = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out)],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    client, (run,) = runs_of(uri)
    check_complete(client, run, run_dir)
