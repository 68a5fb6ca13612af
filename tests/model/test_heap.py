"""The heap a training process keeps between steps, and its return to the OS once the steps are over."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pipeline.trainer.phases import Profile

CHILD = textwrap.dedent("""
    import numpy as np
    from pipeline.model import minigpt

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    assert minigpt.keep_freed_memory()
    blocks = [np.ones(1 << 20) for _ in range(64)]  # 64 x 8 MiB, each below the raised mmap threshold
    del blocks
    kept = rss_kib()
    minigpt.release_freed_memory()
    print(kept, rss_kib())
""")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc tuning is Linux-only"
)
def test_the_heap_kept_between_steps_is_handed_back_at_the_end():
    # keep_freed_memory keeps freed temporaries' pages (no page faults in the next step); the job's end hands
    # them back before matplotlib loads, so its peak RSS is the working set's, not the two stacked.
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
    ).stdout
    kept, after = map(int, out.split())
    assert kept - after > 400 * 1024, (kept, after)  # of the 512 MiB freed, the pages come back


def test_the_job_end_hands_the_heap_back_before_drawing(monkeypatch):
    from pipeline.run import loop

    calls = []
    monkeypatch.setattr(loop, "release_freed_memory", lambda: calls.append("release"))

    class Stop(Exception):
        pass

    def draw(self):
        calls.append("draw")
        raise Stop

    monkeypatch.setattr(loop.Run, "_draw", draw)
    with pytest.raises(Stop):
        run = object.__new__(loop.Run)
        run.profile = Profile(None)  # no phase table
        loop.Run._summary(run, "complete")
    assert calls == ["release", "draw"]
