"""Kill points for the verifier's chaos mode: PIPELINE_CHAOS=<phase>:<k> SIGKILLs this process at the k-th point.

Points sit inside training steps ("train") and inside checkpoint writes ("save"). Unset, a point is one
dictionary lookup. PIPELINE_CHAOS_TRACE=<file> appends every point reached, to count them.
"""
from __future__ import annotations

import os
import signal

_spec = os.environ.get("PIPELINE_CHAOS", "")
_phase, _, _k = _spec.partition(":")
_target = int(_k) if _k.isdigit() else None
_trace = os.environ.get("PIPELINE_CHAOS_TRACE")
_hits = {"train": 0, "save": 0}


def point(phase: str, where: str) -> None:
    if _target is None and _trace is None:
        return
    _hits[phase] += 1
    if _trace is not None:
        with open(_trace, "a") as f:
            f.write(f"{phase} {_hits[phase]} {where}\n")
    if phase == _phase and _hits[phase] == _target:
        os.kill(os.getpid(), signal.SIGKILL)
