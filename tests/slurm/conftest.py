"""`slurm_cluster`: a live single-node SLURM cluster for the tests marked `slurm`.

`.ci/run` brings one up before pytest and names its directory in PIPELINE_SLURM_DIR; the fixture then uses
it and leaves it running. Otherwise the fixture brings its own up in a temporary directory and stops it at
the end of the session. Without the packages (or without root) every slurm test skips, saying how to
enable them.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import cluster as slurm  # noqa: E402  (tests/slurm/cluster.py is also a script, not a package module)

ENV_DIR = "PIPELINE_SLURM_DIR"
HOW = "run `python tests/slurm/cluster.py install` as root (CI does)"


def unavailable() -> str | None:
    """Why this machine cannot run a cluster, in one line; None when it can."""
    missing = slurm.missing()
    if missing:
        return f"slurm tests skipped: {'/'.join(missing[:3])}{'...' if len(missing) > 3 else ''} not installed; {HOW}"
    if os.geteuid() != 0:
        return "slurm tests skipped: slurmd must run as root; run the tests as root (CI does)"
    return None


def pytest_runtest_setup(item) -> None:
    """Skip every `slurm` test here with one reason from one place, so the summary shows it on one line."""
    if item.get_closest_marker("slurm") is not None:
        why = unavailable()
        if why:
            pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    """Skips (one line, saying how to enable) unless the packages are installed and we are root."""
    why = unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster(slurm_installed, tmp_path_factory):
    """The running cluster (tests/slurm/cluster.py's Cluster); `.env` is what client commands need."""
    shared = os.environ.get(ENV_DIR)
    if shared:
        c = slurm.Cluster.load(shared)
        dead = sorted(set(c.pids) - set(c.alive()))
        if dead:
            pytest.fail(f"{ENV_DIR}={shared}: {', '.join(dead)} not running; bring it up with "
                        f"`python tests/slurm/cluster.py up --dir {shared}`\n{c.logs()}")
        yield c
        return
    # a short path: the munge socket and slurmd's step sockets live inside it (sun_path is 108 bytes)
    c = slurm.up(tmp_path_factory.mktemp("slurm", numbered=True))
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch) -> dict[str, str]:
    """os.environ plus the cluster's client variables, also set in this test's environment."""
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return slurm_cluster.client_env()
