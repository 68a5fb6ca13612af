"""The team setup on the live local cluster: every job of a SLURM sweep reports to an `mlflow server` on
PostgreSQL, and the server's index is, field by field, what `reindex --tracking-uri` rebuilds from disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Proc, env_for_subprocess, wait_until
from test_slurm_pipeline import submitted

from pipeline.tracking.link import wait_idle

sys.path.insert(0, str(Path(__file__).parents[1] / "tracking"))
from index_compare import same_index, snapshot

WAIT = 900  # seconds for anything on the cluster (a loaded machine is slow)
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.xdist_group("slurm"),
    pytest.mark.slow,  # one cluster: one worker
    pytest.mark.timeout(3 * WAIT),
]
EXPERIMENT = "team-slurm"


def test_a_slurm_sweep_reports_every_job_to_the_postgres_server(
    slurm_cluster, slurm_env, postgres_mlflow_server, tmp_path
):
    server, out = postgres_mlflow_server[0], tmp_path / "out"
    sweep = Proc(
        [
            "-m",
            "hydra/launcher=slurm",
            f"hydra.launcher.partition={slurm_cluster.partition}",
            "experiment=kernodeck",
            "trainer.progress_bar=false",
            "optimizer.lr=0.01,0.02,0.05",
            "tracking=server",
            f"tracking.uri={server}",
            f"tracking.experiment={EXPERIMENT}",
            f"paths.output_dir={out}",
        ],
        tmp_path / "cwd",
    )
    wait_until(lambda: sweep.p.poll() is not None, "the sweep on SLURM", limit=WAIT)
    assert sweep.p.returncode == 0, sweep.stderr[-4000:]
    assert len(submitted(out)) == 3  # three tasks of one array, run by SLURM
    assert wait_idle(server)

    live = snapshot(server, (EXPERIMENT,))
    (parent_key,) = [k for k in live if k[0] == "parent"]
    children = {k: v for k, v in live.items() if v["parent"] == parent_key}
    assert (
        live[parent_key]["status"] == "FINISHED" and live[parent_key]["tags"]["sweep.failed"] == "0"
    )
    assert sorted(c["tags"]["sweep.job_num"] for c in children.values()) == ["0", "1", "2"]
    assert all(
        c["status"] == "FINISHED" and len(c["metrics"]["train/loss"]) > 0 for c in children.values()
    )
    assert {Path(k[1]) for k in children} == {p.resolve() for p in (out / "runs").iterdir()}

    fresh = f"sqlite:///{tmp_path}/rebuilt.db"
    rebuilt = subprocess.run(
        [sys.executable, "-m", "pipeline.reindex", str(out), "--tracking-uri", fresh],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    same_index(live, snapshot(fresh))
