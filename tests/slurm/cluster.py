"""A single-node SLURM cluster that lives in one directory: install, up, status, down (a module and a CLI).

    python tests/slurm/cluster.py install            # apt-get install slurmctld slurmd slurm-client munge (root)
    python tests/slurm/cluster.py up --dir DIR       # munged, slurmctld, slurmd; waits until the node is idle
    python tests/slurm/cluster.py env --dir DIR      # `export SLURM_CONF=...` lines for a shell
    python tests/slurm/cluster.py status --dir DIR
    python tests/slurm/cluster.py down --dir DIR     # cancels jobs, stops exactly the pids `up` started

Everything the daemons write (slurm.conf, munge key and socket, state, spool, logs, pid files) is inside DIR;
client commands find the cluster through SLURM_CONF alone (the munge socket is named in slurm.conf). The
daemons run in the foreground as children of `up` in their own sessions, so their pids are the ones started;
`DIR/cluster.json` records each pid with its start time, and `down` signals a pid only while both still match.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PACKAGES = (
    "slurmctld",
    "slurmd",
    "slurm-client",
    "munge",
)  # without recommends: 8 packages instead of 43
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
PARTITION = "debug"
CPUS = 8  # advertised; the machine has 2 cores (see slurm_conf)
MARKER = "PIPELINE_SLURM_CLUSTER"  # in every daemon's environment, so strays (slurmstepd) can be told apart


class ClusterError(RuntimeError):
    """The cluster could not be brought up, or a command against it failed."""


def missing() -> list[str]:
    """The daemons and client commands not on PATH (or in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [c for c in (*DAEMONS, *CLIENTS) if shutil.which(c, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(
        name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    )
    if found is None:
        raise ClusterError(f"{name} is not installed; run `python {__file__} install` as root")
    return found


def install() -> bool:
    """apt-get install the packages if a daemon or client is missing; True when everything is there after."""
    if not missing():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        why = "not root" if os.geteuid() != 0 else "no apt-get"
        print(f"slurm: not installing {' '.join(PACKAGES)} ({why}); missing: {' '.join(missing())}")
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Debian's postinst scripts start munge and slurm through invoke-rc.d; in CI's container its policy-rc.d
    # (exit 101) refuses and nothing starts. On a machine booted with systemd, munge.service would start.
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # a stale or missing package list: update once, then try again
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:]
        print(f"slurm: `{' '.join(cmd)}` failed (exit {r.returncode}): {' '.join(last)}")
        return False
    return not missing()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited between the check and the signal
        os.kill(pid, sig)


def slurm_conf(d: Path, host: str, ctld_port: int, slurmd_port: int, cpus: int, mem_mb: int) -> str:
    """slurm.conf for one node named after this host, everything under `d`."""
    return f"""\
# A single-node test cluster; written by tests/slurm/cluster.py.
ClusterName=pipeline
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={d}/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# no cgroups, no accounting daemon: nothing outside {d}, nothing that needs systemd. Without slurmdbd,
# sacct fails, so submitit sees every job as UNKNOWN: its launcher waits for a job's result file and never
# learns that a job FAILED (a test that kills a job must stop its launcher itself)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
# a node that went DOWN (slurmd restarted, missed a ping) returns as soon as it registers again
ReturnToService=2
# batch jobs may be requeued (scontrol requeue, sbatch --requeue); the requeued job keeps its id
JobRequeue=1
# short waits: TERM -> KILL after 10 s, finished jobs visible to scontrol for 5 minutes; submitted jobs
# start at once, a requeued job within 2 s of its begin time (the main loop runs every 2 s, not 60 s)
KillWait=10
OverTimeLimit=0
InactiveLimit=0
MinJobAge=300
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=5
# {cpus} CPUs are advertised on a {os.cpu_count()}-core machine, so a sweep's jobs run side by side
# (like processes on a laptop) instead of two at a time; memory is not a consumable resource.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 \
RealMemory={mem_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    """A running cluster: its directory, its daemons' pids (with start times) and the client environment."""

    dir: str
    host: str
    partition: str
    ports: dict[str, int]
    pids: dict[str, int] = field(default_factory=dict)
    start_times: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return Path(self.dir) / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client command (sbatch, srun, squeue, submitit) needs on top of os.environ."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """A client command against this cluster, output captured as text."""
        r = subprocess.run(
            cmd, env=self.client_env(), capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise ClusterError(
                f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}"
            )
        return r

    def alive(self) -> dict[str, int]:
        """The daemons this cluster started that are still running (same pid and start time)."""
        return {n: p for n, p in self.pids.items() if _start_time(p) == self.start_times.get(n)}

    def node_state(self) -> str:
        r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return r.stdout.strip() if r.returncode == 0 else f"(sinfo failed: {r.stderr.strip()})"

    def jobs(self) -> list[str]:
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    def save(self) -> None:
        path = Path(self.dir) / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, d: str | Path) -> Cluster:
        path = Path(d) / "cluster.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise ClusterError(f"{path} does not exist: no cluster was brought up in {d}") from None

    def logs(self, lines: int = 15) -> str:
        """The last `lines` lines of every log in the cluster directory, for error messages."""
        out = []
        for log in sorted((Path(self.dir) / "log").glob("*")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    def down(self, wait: float = 60) -> list[str]:
        """Cancel every job, then stop the daemons this cluster started: SIGTERM, wait, SIGKILL.

        Returns what had to be killed with SIGKILL (empty when everything stopped on SIGTERM).
        """
        if "slurmctld" in self.alive():
            jobs = self.jobs()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + wait
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        killed = []
        for name in (
            "slurmd",
            "slurmctld",
            "munged",
        ):  # munged last: the others talk to it while stopping
            killed += self._stop({name: self.pids[name]} if name in self.alive() else {}, wait)
        killed += self._stop(self.strays(), wait)  # e.g. a slurmstepd whose job would not die
        return killed

    def _stop(self, procs: dict[str, int], wait: float) -> list[str]:
        starts = {n: _start_time(p) for n, p in procs.items()}
        for p in procs.values():
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(
            _start_time(p) == starts[n] for n, p in procs.items()
        ):
            time.sleep(0.2)
        killed = []
        for n, p in procs.items():
            if _start_time(p) == starts[n]:
                _signal(p, signal.SIGKILL)
                killed.append(f"{n}[{p}]")
        for p in procs.values():  # reap our own children so no zombie stays behind
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p, os.WNOHANG)
        return killed

    def strays(self) -> dict[str, int]:
        """slurm/munge processes started on behalf of this cluster but not by it (slurmstepd, forks)."""
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in self.pids.values():
                continue
            try:
                comm = (proc / "comm").read_text().strip()
                if not comm.startswith(("slurm", "munge")):
                    continue
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{MARKER}={self.dir}".encode() in environ:
                found[f"{comm}:{proc.name}"] = int(proc.name)
        return found


def up(d: str | Path, timeout: float = 180, cpus: int = CPUS) -> Cluster:
    """Write the configuration into `d`, start munged, slurmctld and slurmd, and wait for an idle node."""
    d = Path(d).resolve()
    if (d / "cluster.json").exists() and Cluster.load(d).alive():
        raise ClusterError(
            f"a cluster is already running in {d} (pids {Cluster.load(d).alive()}); `down` it first"
        )
    for sub in ("munge", "state", "spool", "run", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(
        d / "munge", 0o755
    )  # munged refuses a socket directory others can write, warns on one they cannot enter
    host = socket.gethostname().split(".")[0]
    mem_mb = int(int(Path("/proc/meminfo").read_text().split()[1]) // 1024 * 0.9)
    ports = {"slurmctld": _free_port(), "slurmd": _free_port()}
    (d / "slurm.conf").write_text(
        slurm_conf(d, host, ports["slurmctld"], ports["slurmd"], cpus, mem_mb)
    )
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)

    cluster = Cluster(dir=str(d), host=host, partition=PARTITION, ports=ports)
    env = {**os.environ, "SLURM_CONF": str(cluster.conf), MARKER: str(d)}
    env.pop("SLURM_JOB_ID", None)  # a daemon must not believe it runs inside a job

    def start(name: str, cmd: list[str]) -> None:
        with open(d / "log" / f"{name}.out", "ab") as out:
            p = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=d,
                start_new_session=True,
            )
        cluster.pids[name] = p.pid
        cluster.start_times[name] = _start_time(p.pid) or 0
        cluster.save()  # saved after each start, so `down` finds whatever did start

    def wait_for(what: str, ok, deadline: float) -> None:
        while not ok():
            dead = [n for n in cluster.pids if n not in cluster.alive()]
            if dead or time.monotonic() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"not within {timeout:.0f} s"
                cluster.down(wait=10)
                raise ClusterError(
                    f"slurm cluster in {d}: {what} failed ({reason})\n{cluster.logs()}"
                )
            time.sleep(0.2)

    deadline = time.monotonic() + timeout
    sock = d / "munge" / "munge.socket"
    start(
        "munged",
        [
            _which("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={d}/run/munged.pid",
            f"--log-file={d}/log/munged.log",
            f"--seed-file={d}/munge/munged.seed",
            "--num-threads=2",
        ],
    )
    wait_for("munged (socket)", lambda: sock.exists(), deadline)
    start(
        "slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(cluster.conf)]
    )  # -c: no state from before
    wait_for(
        "slurmctld (scontrol ping)",
        lambda: "UP" in cluster.run("scontrol", "ping", check=False).stdout,
        deadline,
    )
    start("slurmd", [_which("slurmd"), "-D", "-f", str(cluster.conf), "-N", host])
    wait_for("slurmd (node idle in sinfo)", lambda: cluster.node_state() == "idle", deadline)
    return cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "up", "down", "status", "env"])
    parser.add_argument("--dir", help="the cluster's directory (up creates it)")
    parser.add_argument(
        "--timeout", type=float, default=180, help="seconds `up` waits for an idle node"
    )
    args = parser.parse_args(argv)
    if args.action == "install":
        return 0 if install() else 1
    if not args.dir:
        parser.error(f"{args.action} needs --dir")
    t0 = time.monotonic()
    try:
        if args.action == "up":
            c = up(args.dir, timeout=args.timeout)
            print(
                f"slurm: node {c.host} idle in {time.monotonic() - t0:.1f} s; pids {c.pids}; "
                f"export SLURM_CONF={c.conf}"
            )
            return 0
        c = Cluster.load(args.dir)
        if args.action == "env":
            print("\n".join(f"export {k}={v}" for k, v in c.env.items()))
        elif args.action == "status":
            alive = c.alive()
            print(
                f"slurm: {c.dir}: alive {alive or 'none'}; node {c.node_state() if 'slurmctld' in alive else '-'}"
                f"; jobs {c.jobs() if 'slurmctld' in alive else '-'}"
            )
            return 0 if len(alive) == len(c.pids) else 1
        elif args.action == "down":
            killed = c.down()
            print(
                f"slurm: stopped {sorted(c.pids)} in {time.monotonic() - t0:.1f} s"
                + (f"; SIGKILL needed for {killed}" if killed else "")
            )
    except ClusterError as e:
        print(f"slurm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
