"""Every command, as a user types it, takes over the signals through the one entry wrapper (run/signals.run_command)
before it imports what it runs: a SIGTERM that arrives the moment its handler is in place ends the command in one
line, `<name>: interrupted by SIGTERM; ...`, and exit 75 (EX_TEMPFAIL), never a traceback nor death by signal."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import env_for_subprocess

from pipeline import TOOLS

# Imported by Python at start-up (PYTHONPATH first): the first SIGTERM handler anyone installs is followed at
# once by a SIGTERM to this process. A command that never installs one exits some other way, and fails here.
SITECUSTOMIZE = """
import os, signal
_real = signal.signal

def _first_then_kill(signum, handler):
    old = _real(signum, handler)
    if signum == signal.SIGTERM and callable(handler):
        signal.signal = _real
        os.kill(os.getpid(), signal.SIGTERM)
    return old

signal.signal = _first_then_kill
"""
COMMANDS = [
    (["-m", "pipeline"], "pipeline"),
    (["-m", "pipeline.verify"], "pipeline.verify"),
    (["-m", "pipeline.tracking.agent", "--listen", "x.sock"], "tracking agent"),
    *((["-m", "pipeline", tool], f"pipeline.{tool}") for tool in TOOLS),
    *((["-m", f"pipeline.{tool}"], f"pipeline.{tool}") for tool in TOOLS),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, name", COMMANDS, ids=[" ".join(a[1:3]) for a, _ in COMMANDS])
def test_every_command_ends_a_signal_through_the_entry_wrapper(tmp_path, argv, name):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = env_for_subprocess()
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 75, proc.stderr
    assert proc.stderr == f"{name}: interrupted by SIGTERM; nothing was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # nothing written
