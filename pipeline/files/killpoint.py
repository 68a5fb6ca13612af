"""Kill points for the verifier's chaos mode: PIPELINE_CHAOS=<phase>:<k> SIGKILLs this process at the k-th point.

Phases: "train" (inside steps), "save" (inside checkpoint writes), "setup" (before a run's checkpoint loads).
<phase>:<k>:TERM+INT sends those signals instead; PIPELINE_CHAOS_TRACE=<file> appends every point reached;
PIPELINE_CHAOS_PACE=<seconds> sleeps at every train and setup point (a slow run, every number unchanged).
"""
from __future__ import annotations

import os
import signal
import time

_phase, _k, _signals = (os.environ.get("PIPELINE_CHAOS", "").split(":") + ["", ""])[:3]
_target = int(_k) if _k.isdigit() else None
_send = [signal.Signals[f"SIG{name}"] for name in _signals.split("+") if name] or [signal.SIGKILL]
_trace = os.environ.get("PIPELINE_CHAOS_TRACE")
_hits = {"train": 0, "save": 0, "setup": 0}
_pace = float(os.environ.get("PIPELINE_CHAOS_PACE") or 0)


def point(phase: str, where: str) -> None:
    if _target is None and _trace is None and not _pace:
        return
    _hits[phase] += 1
    if _trace is not None:
        with open(_trace, "a") as f:
            f.write(f"{phase} {_hits[phase]} {where}\n")
    if _pace and phase in ("train", "setup"):
        time.sleep(_pace)  # after the trace: a test sees where the process is waiting
    if phase == _phase and _hits[phase] == _target:
        for sig in _send:
            os.kill(os.getpid(), sig)
