"""The pipeline on the live local cluster through `hydra/launcher=slurm`: a sweep equal to the basic
launcher's, and a time limit, `scontrol requeue`, `scancel --signal=TERM` and a hard kill that all end in a
resumed job whose checkpoints are byte-identical to an uninterrupted run's.

How long a segment of a time-limited job trains depends on when slurmctld's 30 s timer sends the warning;
the jobs here are paced (PIPELINE_CHAOS_PACE: a sleep in every update, no number changed) so that a run
lasts long enough on any machine, however fast, for a one-minute limit to interrupt it at least twice."""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path

import pytest
from conftest import Proc, run_pipeline, wait_until

from pipeline.run.directory import RunDir
from pipeline.verify.chaos import final_state

# A small MiniGPT, paced to at least PACE_S per update in the SLURM jobs (the references run unpaced).
MINIGPT = (
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "data.n_sentences=400",
    "data.block_size=16",
    "trainer.batch_size=8",
    "trainer.progress_bar=false",
    "checkpoint=every_n_steps",
    "trainer.log_every=10",
)
PACE_S = 0.1
LIMIT_S, DELAY_S = (
    60,
    20,
)  # one minute (SLURM's least), warned 20 s before: the warning lands 10-40 s in
WAIT = 900  # seconds for anything on the cluster; a loaded machine is slow, a requeue takes ~7 s
# each test waits up to WAIT on the cluster at several points: the suite-wide hang guard would cut a loaded run short
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.xdist_group("slurm"),
    pytest.mark.slow,  # one cluster: one worker
    pytest.mark.timeout(3 * WAIT),
]


def launcher(partition: str, *extra: str) -> tuple[str, ...]:
    return ("hydra/launcher=slurm", f"hydra.launcher.partition={partition}", *extra)


def lasting(train_s: float, checkpoints: int = 10) -> tuple[str, ...]:
    """MINIGPT for at least `train_s` seconds of paced training, checkpointed `checkpoints` times."""
    every = math.ceil(train_s / PACE_S / checkpoints)
    return (
        *MINIGPT,
        f"trainer.max_steps={every * checkpoints}",
        f"trainer.eval_every={every * 2}",
        f"checkpoint.every_steps={every}",
    )


def reference(overrides: tuple[str, ...], out: Path) -> Path:
    """The uninterrupted run, here and unpaced."""
    proc = run_pipeline(
        [*overrides, "tracking=none", f"paths.output_dir={out}"], out.parent / "cwd"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def on_slurm(command: list[str], cwd: Path) -> Proc:
    return Proc(
        command, cwd, env={"PIPELINE_CHAOS_PACE": str(PACE_S / 2)}
    )  # two training points per update


def submitted(out: Path) -> list[str]:
    """The SLURM ids of the jobs submitit submitted for the sweeps under `out`: JOB for a lone job,
    ARRAYJOB_TASK for each task of an array (whose own folder, ARRAYJOB, is left out)."""
    names = [
        p.name for p in out.glob("sweeps/*/.submitit/*") if re.fullmatch(r"\d+(_\d+)?", p.name)
    ]
    arrays = {n.split("_")[0] for n in names if "_" in n}
    return sorted(n for n in names if n not in arrays)


def job_field(cluster, job: str, key: str) -> str:
    out = cluster.run("scontrol", "show", "job", job, "-o", check=False).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else ""


def newest_step(out: Path) -> int:
    runs = list((out / "runs").glob("*"))
    steps = [s for run in runs for s, _ in RunDir(run).store.steps()]
    return max(steps, default=0)


def run_json(out: Path) -> dict:
    (run,) = (out / "runs").iterdir()
    return json.loads((run / "run.json").read_text())


def resumed_past(out: Path, times: int) -> bool:
    """The run has resumed `times` times and saved a checkpoint after its last resume."""
    resumes = run_json(out)["resumes"] if list((out / "runs").glob("*/run.json")) else []
    return len(resumes) == times and newest_step(out) > resumes[-1]["step"]


def the_family(out: Path):
    """(parent, children) of the one sweep in `out`'s sqlite store, once the tracking agent has completed it."""
    from mlflow import MlflowClient

    from pipeline.tracking.link import wait_idle

    assert wait_idle(f"sqlite:///{out}/mlflow.db")

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], max_results=100
    )
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1, [r.data.tags.get("mlflow.runName") for r in runs]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    return parents[0], children


def finished(proc: Proc, what: str) -> None:
    wait_until(lambda: proc.p.poll() is not None, what, limit=WAIT)
    assert proc.p.returncode == 0, f"{what}: exit {proc.p.returncode}\n{proc.stderr[-4000:]}"


def same_run(reference: Path, resumed: Path) -> None:
    """Every kept checkpoint's state files, the links, the final state and every logged number: equal."""
    ref, got = final_state(reference), final_state(resumed)
    assert sorted(got["checkpoints"]) == sorted(ref["checkpoints"]), (
        "different checkpoint directories kept"
    )
    assert got["links"] == ref["links"]
    for key in ("weights", "optim", "extra", "checkpoints", "metrics"):
        assert got[key] == ref[key], f"{key} differs from the uninterrupted run's"


def test_a_four_job_sweep_equals_the_basic_launchers(slurm_cluster, slurm_env, tmp_path):
    swept = (
        "experiment=kernodeck",
        "trainer.progress_bar=false",
        "optimizer.lr=0.01,0.02,0.03,0.05",
    )
    basic = run_pipeline(["-m", *swept, f"paths.output_dir={tmp_path / 'basic'}"], tmp_path / "cwd")
    assert basic.returncode == 0, basic.stderr[-3000:]
    sweep = Proc(
        [
            "-m",
            *launcher(slurm_cluster.partition),
            *swept,
            f"paths.output_dir={tmp_path / 'slurm'}",
        ],
        tmp_path / "cwd",
    )
    finished(sweep, "the sweep on SLURM")
    assert len(submitted(tmp_path / "slurm")) == 4

    (parent_b, children_b), (parent_s, children_s) = (
        the_family(tmp_path / "basic"),
        the_family(tmp_path / "slurm"),
    )
    assert parent_s.info.status == parent_b.info.status == "FINISHED"
    assert parent_s.data.params == parent_b.data.params
    tags_s, tags_b = (
        {k: v for k, v in p.data.tags.items() if k.startswith(("sweep", "best"))}
        for p in (parent_s, parent_b)
    )
    assert sorted(tags_s) == sorted(tags_b)
    where = (
        "sweep.launcher",
        "sweep.overrides",
        "sweep.dir",
        "sweep.id",
        "best.run_id",
    )  # differ by design
    assert {k: v for k, v in tags_s.items() if k not in where} == {
        k: v for k, v in tags_b.items() if k not in where
    }
    by_name = {c.data.tags["mlflow.runName"]: c for c in children_b}
    assert sorted(by_name) == sorted(c.data.tags["mlflow.runName"] for c in children_s)
    for child in children_s:
        twin = by_name[child.data.tags["mlflow.runName"]]
        assert child.info.status == "FINISHED"
        assert child.data.params == twin.data.params
        assert child.data.metrics == twin.data.metrics
        same_run_dir = Path(child.data.tags["run_dir"]), Path(twin.data.tags["run_dir"])
        assert same_run_dir[0].name == same_run_dir[1].name
    for run in (tmp_path / "basic" / "runs").iterdir():
        ref, got = RunDir(run), RunDir(tmp_path / "slurm" / "runs" / run.name)
        assert list(got.read_metrics()) != []
        strip = lambda lines: [{k: v for k, v in line.items() if k != "time"} for line in lines]  # noqa: E731
        assert strip(got.read_metrics()) == strip(ref.read_metrics())


def test_a_time_limit_requeues_the_job_until_it_ends_as_if_never_stopped(
    slurm_cluster, slurm_env, tmp_path
):
    overrides = lasting(
        train_s=100
    )  # the warning lands 10-40 s into each segment: two requeues at least
    out = tmp_path / "slurm"
    job = on_slurm(
        [
            "-m",
            *launcher(
                slurm_cluster.partition,
                f"hydra.launcher.timeout_min={LIMIT_S // 60}",
                f"hydra.launcher.signal_delay_s={DELAY_S}",
            ),
            *overrides,
            f"paths.output_dir={out}",
        ],
        tmp_path / "cwd",
    )
    ref = reference(overrides, tmp_path / "ref")
    finished(job, "the time-limited job")
    (task,) = submitted(out)
    restarts = int(job_field(slurm_cluster, task, "Restarts") or 0)
    resumes = run_json(out)["resumes"]
    assert restarts >= 2 and len(resumes) == restarts, (restarts, resumes)
    same_run(ref, out)
    parent, (child,) = the_family(out)
    assert parent.info.status == child.info.status == "FINISHED"
    assert child.data.tags["resumes"] == str(restarts)


def test_scontrol_requeue_and_scancel_term_mid_run_resume_it_as_if_never_stopped(
    slurm_cluster, slurm_env, tmp_path
):
    overrides = lasting(train_s=30)
    out = tmp_path / "slurm"
    job = on_slurm(
        ["-m", *launcher(slurm_cluster.partition), *overrides, f"paths.output_dir={out}"],
        tmp_path / "cwd",
    )
    ref = reference(overrides, tmp_path / "ref")
    wait_until(lambda: newest_step(out) > 0, "the job's first checkpoint", job, limit=WAIT)
    (task,) = submitted(out)
    slurm_cluster.run("scontrol", "requeue", task)  # what a preemption does
    # training again after the requeue: resumed once, and a checkpoint past the one it resumed from (the
    # checkpoint the requeue's SIGTERM saves is not enough: a signal before the requeued job's Python has
    # started would reach the batch shell, not the run)
    wait_until(lambda: resumed_past(out, 1), "the requeued job's next checkpoint", job, limit=WAIT)
    slurm_cluster.run("scancel", "--signal=TERM", task)  # to the job's steps: the job stays RUNNING
    finished(job, "the twice interrupted job")
    assert job_field(slurm_cluster, task, "Restarts") == "2"
    assert len(run_json(out)["resumes"]) == 2
    same_run(ref, out)
    parent, (child,) = the_family(out)
    assert (
        parent.info.status == child.info.status == "FINISHED" and child.data.tags["resumes"] == "2"
    )


def test_a_hard_killed_job_resumes_when_the_identical_command_runs_again(
    slurm_cluster, slurm_env, tmp_path
):
    overrides = lasting(train_s=20)
    out = tmp_path / "slurm"
    command = ["-m", *launcher(slurm_cluster.partition), *overrides, f"paths.output_dir={out}"]
    job = on_slurm(command, tmp_path / "cwd")
    ref = reference(overrides, tmp_path / "ref")
    wait_until(lambda: newest_step(out) > 0, "the job's first checkpoint", job, limit=WAIT)
    (task,) = submitted(out)
    slurm_cluster.run("scancel", "--signal=KILL", task)
    wait_until(
        lambda: job_field(slurm_cluster, task, "JobState") not in ("RUNNING", "COMPLETING"),
        "the killed job to end",
        limit=WAIT,
    )
    assert job_field(slurm_cluster, task, "JobState") != "COMPLETED"
    # without accounting the launcher cannot learn that the job failed: its user gives up on it
    job.send_signal(signal.SIGKILL)
    job.wait()
    killed_at = newest_step(out)
    again = on_slurm(command, tmp_path / "cwd")
    finished(again, "the identical command")
    assert len(submitted(out)) == 2
    assert [r["step"] for r in run_json(out)["resumes"]] == [killed_at]
    same_run(ref, out)
    parent, (child,) = the_family(out)
    assert (
        parent.info.status == child.info.status == "FINISHED" and child.data.tags["resumes"] == "1"
    )


def test_a_signal_to_the_launcher_stops_its_slurm_jobs_and_the_identical_command_continues(
    slurm_cluster, slurm_env, tmp_path
):
    # two jobs, one at a time: the running one is sent the signal, the pending one refuses to start
    command = [
        "-m",
        *launcher(slurm_cluster.partition, "hydra.launcher.array_parallelism=1"),
        *lasting(train_s=20),
        "trainer.seed=1,2",
        f"paths.output_dir={tmp_path / 'slurm'}",
    ]
    out = tmp_path / "slurm"
    sweep = on_slurm(command, tmp_path / "cwd")
    wait_until(lambda: newest_step(out) > 0, "the first job's first checkpoint", sweep, limit=WAIT)
    sweep.send_signal(signal.SIGTERM)
    wait_until(lambda: sweep.p.poll() is not None, "the stopped sweep's launcher", limit=WAIT)
    assert sweep.p.returncode == 75, sweep.stderr[-3000:]
    assert "the sweep was interrupted; 2 of 2 jobs did not finish" in sweep.stderr
    wait_until(lambda: not slurm_cluster.jobs(), "the sweep's jobs to leave the queue", limit=WAIT)
    tasks = submitted(out)
    assert len(tasks) == 2 and all(
        job_field(slurm_cluster, t, "Restarts") == "0" for t in tasks
    )  # not requeued
    (run,) = (out / "runs").iterdir()  # the pending job never started its run
    assert json.loads((run / "run.json").read_text())["status"] == "preempted"
    stopped_at = newest_step(out)

    again = on_slurm(command, tmp_path / "cwd")
    finished(again, "the identical command")
    runs = {p.name: json.loads((p / "run.json").read_text()) for p in (out / "runs").iterdir()}
    assert len(runs) == 2 and all(r["status"] == "complete" for r in runs.values())
    assert [r["step"] for r in runs[run.name]["resumes"]] == [stopped_at]
    parent, children = the_family(out)
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert all(c.info.status == "FINISHED" for c in children)
