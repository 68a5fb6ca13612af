"""Kill points for the verifier's chaos mode: PIPELINE_CHAOS=<phase>:<k> SIGKILLs this process at the k-th point.

Points sit inside training steps ("train"), inside checkpoint writes ("save") and at the start of a run's
set-up ("setup", before its checkpoint is loaded). Unset, a point is one
dictionary lookup. PIPELINE_CHAOS=<phase>:<k>:TERM+INT sends those signals instead of SIGKILL (a signal
arriving in the middle of a save). PIPELINE_CHAOS_TRACE=<file> appends every point reached, to count them.
PIPELINE_CHAOS_PACE=<seconds> sleeps that long at every training point (two per update): a run that lasts
long enough for a test of time limits on any machine, with every number unchanged; it sleeps at the set-up
point too (a slow load, for a test of a signal during set-up).
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
