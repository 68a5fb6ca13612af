"""On a terminal: the bar carries throughput, and nothing (validation lines, mlflow's lines from the tracker's
thread, the tracking agent, a separate process) is written into the middle of it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from tests.conftest import TINY, env_for_subprocess

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LOG = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+\]\[[\w.]+\]\[[A-Z]+\] - ")
BAR = re.compile(r"train:\s+\d+%\|.*\| \d+/\d+ \[")


def on_a_terminal(args: list[str], cwd) -> tuple[int, str]:
    """`python -m pipeline *args` with stdout and stderr on a pseudo-terminal 120 columns wide; (code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=env_for_subprocess(),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def segments(text: str) -> list[str]:
    """What the terminal shows piece by piece: lines, and the redraws of a line (split at carriage returns)."""
    return [seg for line in text.split("\n") for seg in line.split("\r") if seg.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("tracking", ["none", "mlflow"])
def test_the_bar_is_never_broken_and_carries_throughput(tmp_path, tracking):
    args = [a for a in TINY if not a.startswith(("trainer.progress_bar", "tracking="))]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # With mlflow a second run finds the agent warm: its "mlflow: run ..." line comes from the tracker's
    # thread while the bar is drawn.
    for seed in [0] if tracking == "none" else [0, 1]:
        code, text = on_a_terminal(
            [
                *args,
                f"tracking={tracking}",
                "trainer.eval_every=2",
                "trainer.max_steps=16",
                f"trainer.seed={seed}",
                f"paths.output_dir={tmp_path / 'out'}",
            ],
            cwd,
        )
        assert code == 0, text
        check_unbroken(text)
        if tracking == "mlflow":
            assert any("mlflow: tracking into" in s for s in segments(text))


def check_unbroken(text: str) -> None:
    segs = segments(text)
    bars = [s for s in segs if BAR.search(s)]
    assert bars, text
    for seg in segs:
        if LOG.search(
            seg
        ):  # a log line starts its line: no fragment of the bar (or anything) glued before it
            assert LOG.match(seg), f"a log line glued into another: {seg!r}"
        elif BAR.search(seg):
            assert BAR.match(seg), f"something glued before the bar: {seg!r}"
        else:  # the continuation lines of the start block and the end summary, nothing else (no agent's output)
            assert re.match(r"(  \S|data[: ]|run directory )", seg), (
                f"not the run's output: {seg!r}"
            )
    assert re.search(r"tok/s=[\d.]+k?", bars[-1]) and "16/16" in bars[-1], bars[-1]
    vals = [s for s in segs if LOG.match(s) and re.search(r"\] - step \d+/16 .*val/loss=", s)]
    assert len(vals) == 8 and all(
        re.search(r"\([\d.]+k? steps/s [\d.]+k? tokens/s\)$", s) for s in vals
    ), vals
