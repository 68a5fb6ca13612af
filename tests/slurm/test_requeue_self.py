"""requeue_self's decision for every state a stopped SLURM job can be in, against a stand-in `scontrol`
that answers like the real one (the live cluster tests cover the real one end to end)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pipeline.run import slurm


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """scontrol(state, reason, restarts): the job's line `scontrol show job -o` prints; every call is logged."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "debug")

    def answer(state: str, reason: str = "None", restarts: int = 0) -> Path:
        script = bin_dir / "scontrol"
        script.write_text(
            f'#!/bin/sh\necho "$@" >> {log}\n'
            f'[ "$1" = show ] && echo "JobId=41 JobName=x JobState={state} Reason={reason} '
            f'Dependency=(null) Requeue=1 Restarts={restarts} BatchFlag=1"\nexit 0\n'
        )
        script.chmod(0o755)
        return log

    return answer


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_outside_slurm_nothing_happens(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm.requeue_self() is None


def test_a_running_job_warned_or_signalled_requeues_itself(scontrol):
    log = scontrol("RUNNING")
    requeued, said = slurm.requeue_self()
    assert requeued and "requeued" in said
    assert calls(log) == ["show job 41 -o", "requeue 41"]


def test_a_job_at_its_time_limit_requeues_itself(scontrol):
    log = scontrol("TIMEOUT", "TimeLimit")
    assert slurm.requeue_self()[0] and calls(log)[-1] == "requeue 41"


def test_a_job_slurm_is_requeueing_leaves_it_to_slurm(scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    log = scontrol(
        "COMPLETING", restarts=3
    )  # `scontrol requeue` or a preemption: the next run is counted
    requeued, said = slurm.requeue_self()
    assert requeued and "being requeued" in said
    assert calls(log) == ["show job 41 -o"]


@pytest.mark.parametrize("then", [1, 0])
def test_a_requeue_that_loses_the_race_to_another_asks_again(scontrol, tmp_path, then):
    """submitit's own handler (or SLURM) requeued the job between our look and our `scontrol requeue`, which
    then fails: a second look that counts the next run says requeued; one that does not, not requeued."""
    log = scontrol("RUNNING")
    count = tmp_path / "shows"
    (tmp_path / "bin" / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n'
        f'if [ "$1" = show ]; then echo x >> {count}; n=$(wc -l < {count}); r=0; [ "$n" -gt 1 ] && r={then}\n'
        f'  echo "JobId=41 JobState=RUNNING Reason=None Restarts=$r"; exit 0; fi\nexit 1\n'
    )
    requeued, said = slurm.requeue_self()
    assert calls(log) == ["show job 41 -o", "requeue 41", "show job 41 -o"]
    assert requeued == bool(then)
    assert (
        ("being requeued" in said)
        if then
        else said == "SLURM job 41: `scontrol requeue` failed: exit 1"
    )


def test_a_cancelled_job_ends_for_good(scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    log = scontrol(
        "COMPLETING", restarts=3
    )  # `scancel`: no requeue, or it would revive a cancelled job
    requeued, said = slurm.requeue_self()
    assert not requeued and "not requeued" in said
    assert calls(log) == ["show job 41 -o"]


def test_an_array_task_is_named_as_its_own_task(scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    log = scontrol("RUNNING")
    slurm.requeue_self()
    assert calls(log) == ["show job 40_1 -o", "requeue 40_1"]  # not 41, not the whole array 40


def test_a_stopped_sweep_signals_the_steps_of_each_job_it_submitted_once(tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(
        f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n'
    )  # ended jobs: an error
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / ".submitit"
    for name in ("12", "12_0", "12_1", "9", ".submission_file_x.sh", "notes"):
        (folder / name).mkdir(parents=True)
    assert slurm.signal_jobs(folder, signal.SIGTERM) == [
        "12",
        "9",
    ]  # an array's id reaches all its tasks
    # to the steps (no --full: the batch shell lives on) of the running jobs (a pending one would be retried later)
    assert calls(log) == ["--state=RUNNING --signal=TERM 12 9"]
    assert slurm.signal_jobs(tmp_path / "none", signal.SIGINT) == []


@pytest.mark.parametrize(
    "target, folder, expected",
    [
        (
            "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
            "/s/.submitit/%j",
            "/s/.submitit",
        ),
        (
            "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
            "/s/jobs/job_%j",
            "/s/jobs",
        ),
        (
            "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
            "/s/.submitit/%j",
            None,
        ),
        ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", None, None),
    ],
)
def test_only_a_slurm_sweep_names_its_submitit_folder(target, folder, expected):
    from omegaconf import OmegaConf

    from pipeline.sweep.callback import _slurm_jobs

    launcher = OmegaConf.create(
        {"_target_": target, **({"submitit_folder": folder} if folder else {})}
    )
    assert _slurm_jobs(launcher) == (Path(expected) if expected else None)
