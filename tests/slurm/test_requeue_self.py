"""requeue_self's decision for every state a stopped SLURM job can be in, against a stand-in `scontrol`
that answers like the real one (the live cluster tests cover the real one end to end)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import slurm


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
        script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                          f'[ "$1" = show ] && echo "JobId=41 JobName=x JobState={state} Reason={reason} '
                          f'Dependency=(null) Requeue=1 Restarts={restarts} BatchFlag=1"\nexit 0\n')
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
    log = scontrol("COMPLETING", restarts=3)  # `scontrol requeue` or a preemption: the next run is counted
    requeued, said = slurm.requeue_self()
    assert requeued and "being requeued" in said
    assert calls(log) == ["show job 41 -o"]


def test_a_cancelled_job_ends_for_good(scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    log = scontrol("COMPLETING", restarts=3)  # `scancel`: no requeue, or it would revive a cancelled job
    requeued, said = slurm.requeue_self()
    assert not requeued and "not requeued" in said
    assert calls(log) == ["show job 41 -o"]


def test_an_array_task_is_named_as_its_own_task(scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    log = scontrol("RUNNING")
    slurm.requeue_self()
    assert calls(log) == ["show job 40_1 -o", "requeue 40_1"]  # not 41, not the whole array 40
