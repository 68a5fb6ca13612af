"""The test cluster itself: jobs run, requeue, and `down` leaves no process and no file behind outside its dir."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import cluster as slurm
import pytest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.xdist_group("slurm"),
]  # one cluster: one worker, in turn

WAIT = 300  # seconds; generous, because the machine may be busy: a pass takes a few seconds
CLUSTER_PY = Path(slurm.__file__)
# Where a default install of slurm or munge would write; a cluster in a temporary directory must not.
SYSTEM_DIRS = [
    "/etc/slurm",
    "/etc/slurm-llnl",
    "/etc/munge",
    "/run/munge",
    "/run/slurm",
    "/run/slurmctld",
    "/run/slurmd",
    "/var/log/slurm",
    "/var/log/munge",
    "/var/lib/slurm",
    "/var/lib/munge",
    "/var/spool/slurm",
    "/var/spool/slurmd",
    "/var/spool/slurmctld",
]
NAMED_IN = [
    "/var/log",
    "/run",
    "/var/run",
    "/var/spool",
    "/var/lib",
    "/etc",
]  # their slurm*/munge* entries


def snapshot() -> dict[str, tuple]:
    """(type, mode, size, mtime, sha256) of every file under SYSTEM_DIRS and every slurm/munge entry of NAMED_IN."""
    paths = set()
    for top in SYSTEM_DIRS:
        if os.path.lexists(top):
            paths.add(Path(top))
            paths.update(Path(top).rglob("*"))
    for top in NAMED_IN:
        if os.path.isdir(top):
            paths.update(p for p in Path(top).iterdir() if re.match(r"(slurm|munge)", p.name))
    out = {}
    for p in sorted(paths):
        st = p.lstat()
        digest = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
        )
        out[str(p)] = (oct(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def wait_for(what: str, ok, timeout: float = WAIT, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{detail()}")
        time.sleep(0.5)


def job_field(c: slurm.Cluster, job: str, key: str) -> str:
    out = c.run("scontrol", "show", "job", job, "-o", check=False).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else ""


def test_srun_hostname_answers(slurm_cluster):
    r = slurm_cluster.run("srun", "--partition", slurm_cluster.partition, "hostname")
    assert r.stdout.strip() == socket.gethostname().split(".")[0]


def test_sbatch_job_runs_writes_output_and_reaches_the_controller(slurm_cluster, tmp_path):
    """The job's environment carries SLURM_CONF, so scontrol works from inside a job (requeue needs it)."""
    script = tmp_path / "job.sh"
    script.write_text(
        '#!/bin/bash\necho "job $SLURM_JOB_ID on $(hostname)"\n'
        "scontrol show job \"$SLURM_JOB_ID\" -o | grep -o 'JobState=[A-Z]*'\n"
    )
    job = slurm_cluster.run(
        "sbatch", "--parsable", f"--output={tmp_path}/out-%j.txt", str(script)
    ).stdout.strip()
    wait_for(
        f"job {job} completed",
        lambda: job_field(slurm_cluster, job, "JobState") == "COMPLETED",
        detail=lambda: slurm_cluster.run("scontrol", "show", "job", job, check=False).stdout,
    )
    out = (tmp_path / f"out-{job}.txt").read_text()
    assert out.splitlines() == [f"job {job} on {slurm_cluster.host}", "JobState=RUNNING"], out


def test_a_job_that_requeues_itself_runs_again_with_its_id(slurm_cluster, tmp_path):
    """What a preempted job will do: `scontrol requeue $SLURM_JOB_ID`, then run again (restart count 1)."""
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "run ${{SLURM_RESTART_COUNT:-0}} of $SLURM_JOB_ID" >> {tmp_path}/runs.txt\n'
        'if [ -z "$SLURM_RESTART_COUNT" ]; then scontrol requeue "$SLURM_JOB_ID"; sleep 60; fi\n'
    )
    job = slurm_cluster.run(
        "sbatch", "--parsable", "--output=/dev/null", str(script)
    ).stdout.strip()
    wait_for(
        f"job {job} requeued and completed",
        lambda: job_field(slurm_cluster, job, "JobState") == "COMPLETED",
        detail=lambda: slurm_cluster.run("scontrol", "show", "job", job, check=False).stdout,
    )
    assert (tmp_path / "runs.txt").read_text().splitlines() == [
        f"run 0 of {job}",
        f"run 1 of {job}",
    ]
    assert job_field(slurm_cluster, job, "Restarts") == "1"


def test_four_jobs_run_at_once(slurm_cluster, tmp_path):
    """A 4-task array (a 4-job sweep) is not serialised by the 2 real cores: the node advertises more CPUs."""
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/bash\ntouch {tmp_path}/started-$SLURM_ARRAY_TASK_ID\n"
        f"while [ ! -e {tmp_path}/go ]; do sleep 0.2; done\n"
    )
    job = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--array=0-3",
        "--cpus-per-task=2",
        "--output=/dev/null",
        str(script),
    ).stdout.strip()
    try:
        wait_for(
            "4 array tasks running at once",
            lambda: len(list(tmp_path.glob("started-*"))) == 4,
            detail=lambda: slurm_cluster.run("squeue", check=False).stdout,
        )
    finally:
        (tmp_path / "go").touch()
    wait_for(
        f"array {job} finished",
        lambda: not slurm_cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip(),
    )


def test_cli_up_and_down_stop_every_pid_and_touch_nothing_outside(slurm_installed, tmp_path):
    """A second cluster through the CLI (as .ci/run does): down stops its daemons and its jobs' processes."""
    before = snapshot()
    d = tmp_path / "c"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(CLUSTER_PY), *args, "--dir", str(d)],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )

    up = cli("up")
    assert up.returncode == 0, up.stdout + up.stderr
    c = slurm.Cluster.load(d)
    try:
        assert set(c.alive()) == {"munged", "slurmctld", "slurmd"}
        assert c.run("srun", "hostname").stdout.strip() == c.host
        c.run("sbatch", "--output=/dev/null", "--wrap", "sleep 600")  # still running at `down`
        wait_for(
            "the sleeping job running",
            lambda: c.run("squeue", "-h", "-t", "R", check=False).stdout.strip(),
            detail=lambda: c.logs(),
        )
        status = cli("status")
        assert status.returncode == 0 and "node mixed" in status.stdout, (
            status.stdout + status.stderr
        )
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert c.alive() == {}, f"still running after down: {c.alive()}"
    assert c.strays() == {}, f"left behind by the cluster: {c.strays()}"
    assert cli("status").returncode == 1
    after = snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the cluster changed files outside {d}: {changed}"


def test_the_slurm_tests_run_on_one_worker(request):
    """Under xdist's loadgroup a test's group is in its node id: proof that the slurm tests carry their group
    where xdist reads it (a mark added by a conftest hook came too late on some pytest versions: the tests were
    spread over the workers, sharing the cluster)."""
    if not request.config.getoption("loadgroup", False) or "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("not under xdist's --dist=loadgroup")
    assert request.node.nodeid.endswith("@slurm"), request.node.nodeid
