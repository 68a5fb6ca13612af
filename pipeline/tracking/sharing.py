"""One warning when a sqlite store is shared beyond one machine: on a network filesystem, or by several hosts."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from pipeline.files.limits import MAX_MOUNTS_BYTES

log = logging.getLogger("pipeline")

# Filesystems whose locks sqlite cannot trust (its own documentation warns against sharing a file over them).
NETWORK_FS: tuple[str, ...] = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs")
NETWORK_FS += ("ceph", "9p", "afs", "fuse.glusterfs", "glusterfs", "fuse.cephfs", "fuse.sshfs")
NETWORK_FS += ("panfs", "orangefs", "pvfs2", "ocfs2", "gfs2")
MOUNTS = Path("/proc/mounts")
HOSTS_TAG = "pipeline.hosts"  # on the store's Default experiment: every host that opened it, comma-separated
MAX_HOSTS = 50
TEAM_SETUP = (
    "run `mlflow server --backend-store-uri postgresql+psycopg://USER@DBHOST/DB --artifacts-destination "
    "DIR --host HOST --port 5000 --allowed-hosts HOST:5000` and track with "
    "`tracking=server tracking.uri=http://HOST:5000` (docs/tracking.md: Team setup)"
)


def read_mounts() -> str:
    """The mount table (empty if it cannot be read), at most MAX_MOUNTS_BYTES."""
    try:
        with open(MOUNTS, "rb") as f:
            return f.read(MAX_MOUNTS_BYTES).decode(errors="replace")
    except OSError:
        return ""


def check_shared(client, db: Path) -> str | None:
    """Record this host on the store; warn (one line, returned) if the store is shared beyond one machine."""
    hosts: set[str] = set()
    try:
        exp = client.get_experiment("0")  # Default: every mlflow store has it
        hosts = {h for h in (exp.tags or {}).get(HOSTS_TAG, "").split(",") if h}
        me = socket.gethostname()
        if me not in hosts and len(hosts) < MAX_HOSTS:
            hosts.add(me)
            client.set_experiment_tag("0", HOSTS_TAG, ",".join(sorted(hosts)))
    except Exception:
        pass
    where, best, kind = Path(os.path.realpath(db.parent)), -1, None
    for line in read_mounts().splitlines():  # its filesystem: the longest mount point above it
        fields = line.split()
        point = Path(fields[1].replace("\\040", " ")) if len(fields) >= 3 else None
        above = point is not None and (point == where or point in where.parents)
        if above and len(str(point)) > best:
            best, kind = len(str(point)), fields[2]
    if kind in NETWORK_FS:
        problem = f"the mlflow store {db} is on a network filesystem ({kind})"
    elif len(hosts) > 1:
        problem = f"the mlflow store {db} is opened by jobs on {len(hosts)} hosts ({', '.join(sorted(hosts)[:5])})"
    else:
        return None
    text = f"{problem}: sqlite's locks are not to be trusted there; for a team or a cluster, {TEAM_SETUP}"
    log.warning(text)
    return text
