"""The team setup: every job reports to an `mlflow server` whose backend store is a real PostgreSQL. After a
preempted and resumed run and a sweep, `reindex --tracking-uri` into a fresh store holds, field by field, what
the server's live index does."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, Proc, env_for_subprocess, run_pipeline, wait_until
from index_compare import same_index, snapshot

from pipeline.run.directory import RunDir
from pipeline.tracking.link import wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("postgres")]  # one server: one worker
EXPERIMENT = "team-postgres"
LONG = (
    "trainer.max_steps=400",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=50",
    "trainer.eval_every=50",
)


def on_server(server: str, out: Path) -> tuple[str, ...]:
    return (
        *KERNODECK[:1],
        "tracking=server",
        f"tracking.uri={server}",
        f"tracking.experiment={EXPERIMENT}",
        f"paths.output_dir={out}",
        "trainer.progress_bar=false",
    )


def preempted(args: list[str], cwd: Path, out: Path, before: set[str]) -> None:
    """`args` paced, sent SIGTERM once a new run of it is past its first checkpoint: exit 75."""
    proc = Proc(args, cwd, env={"PIPELINE_CHAOS_PACE": "0.01"})
    wait_until(
        lambda: any(
            len(RunDir(p.parent).read_metrics()) > 60
            for p in (out / "runs").glob("*/metrics.jsonl")
            if p.parent.name not in before
        ),
        "a run past its first checkpoint",
        proc,
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr[-3000:]


def test_a_resumed_run_and_a_sweep_on_postgres_index_as_a_rebuild_does(
    tmp_path, postgres_mlflow_server
):
    server = postgres_mlflow_server[0]
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    # a run preempted mid-run, then resumed by the same command
    preempted([*on_server(server, out), *LONG], cwd, out, set())
    assert wait_idle(server)
    proc = run_pipeline([*on_server(server, out), *LONG], cwd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # a grid sweep, one of whose jobs is the lone run's configuration
    proc = run_pipeline(["-m", "optimizer.lr=0.01,0.03", *on_server(server, out), *LONG], cwd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert wait_idle(server), "the tracking agent went away before the index was complete"

    live = snapshot(server, (EXPERIMENT,))
    (parent,) = [v for k, v in live.items() if k[0] == "parent"]
    assert parent["status"] == "FINISHED" and parent["tags"]["sweep.jobs"] == "2"
    resumed = [v for k, v in live.items() if k[0] == "run" and v["tags"].get("resumes") == "1"]
    assert len(resumed) == 1 and len(resumed[0]["metrics"]["train/loss"]) == 400
    assert (
        len([v for v in live.values() if v["parent"] == next(k for k in live if k[0] == "parent")])
        == 2
    )

    fresh = f"sqlite:///{tmp_path}/rebuilt.db"
    rebuilt = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.reindex",
            str(out),
            "--tracking-uri",
            fresh,
            "--artifact-location",
            str(tmp_path / "rebuilt-artifacts"),
        ],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    same_index(live, snapshot(fresh))
