"""A SLURM job told to stop (a time-limit warning, a signal to its steps) requeues itself (docs/slurm.md)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path


def requeue_self() -> tuple[bool, str] | None:
    """Make sure this SLURM job runs again: (True, a sentence for the log) if it is requeued, (False, why) if it
    ends for good, None outside SLURM. Call it last: SLURM answers a requeue with SIGTERM to the job."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_JOB_PARTITION") is None or shutil.which("scontrol") is None:
        return None
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        # an array task by its own name: its SLURM_JOB_ID can be the array's, whose requeue requeues every task
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"

    def requeued_already(fields: dict) -> bool:
        # a requeue by SLURM (scontrol, preemption, submitit's handler) counts the next run before this one ends
        return int(fields.get("Restarts") or 0) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    name = f"SLURM job {job}"
    again = True, f"{name} is being requeued: it resumes from its newest checkpoint"
    try:
        fields = _job_fields(job)
        state, reason = fields.get("JobState", "?"), fields.get("Reason", "?")
        if requeued_already(fields):
            return again
        if state != "RUNNING" and reason != "TimeLimit":  # ending for good (scancel): not revived
            return False, f"{name} is {state} (reason {reason}): it ends here, not requeued"
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if r.returncode != 0 and requeued_already(_job_fields(job)):  # another requeue came first
            return again
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return False, f"{name}: scontrol failed ({e}): not requeued"
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip() or f"exit {r.returncode}"
        return False, f"{name}: `scontrol requeue` failed: {said}"
    said = f"({state}, reason {reason}) requeued: it resumes from its newest checkpoint"
    return True, f"{name} {said}"


def _job_fields(job: str) -> dict:
    """`scontrol show job JOB -o` as {field: value}."""
    args = ["scontrol", "show", "job", job, "-o"]
    shown = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def signal_jobs(submitit_dir: Path, signum: int) -> list[str]:
    """Pass a signal to the steps of every SLURM job submitted from `submitit_dir` (its folders are the job ids);
    returns the ids. A job not running is left alone: one that starts later refuses to (the sweep's marker)."""
    if shutil.which("scancel") is None or not submitit_dir.is_dir():
        return []
    names = [p.name for p in submitit_dir.iterdir()]
    ids = sorted({n.split("_")[0] for n in names if re.fullmatch(r"\d+(_\d+)?", n)})
    if ids:
        try:
            # the running ones only: to a pending task scancel answers "try again later" and retries 5 s later,
            # when the task may have just started, before its Python handles signals (it dies without a result)
            sig = signal.Signals(signum).name[3:]
            args = ["scancel", "--state=RUNNING", f"--signal={sig}", *ids]
            subprocess.run(args, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return []  # an unreachable controller: the jobs run on; the pending ones still refuse to start
    return ids
