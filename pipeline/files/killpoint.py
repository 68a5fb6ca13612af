"""Kill points for the verifier's chaos mode: PIPELINE_CHAOS=<phase>:<k> SIGKILLs this process at the k-th point.

Phases: "train" (inside steps), "save" (inside checkpoint writes), "setup" (before a run's checkpoint loads).
<phase>:<k>:TERM+INT sends those signals instead; PIPELINE_CHAOS_TRACE=<file> appends every point reached;
PIPELINE_CHAOS_PACE=<seconds> sleeps at every train and setup point (a slow run, every number unchanged).
"""

from __future__ import annotations

import functools
import os
import signal
import time


@functools.cache  # one plan, read at the first kill point, not on import: importing this module keeps nothing
class _Plan:
    """What PIPELINE_CHAOS* ask of this process, and the points reached so far."""

    def __init__(self):
        phase, k, signals = ([*os.environ.get("PIPELINE_CHAOS", "").split(":"), "", ""])[:3]
        self.phase, self.target = phase, int(k) if k.isdigit() else None
        sent = [signal.Signals[f"SIG{name}"] for name in signals.split("+") if name]
        self.send = sent or [signal.SIGKILL]
        self.trace = os.environ.get("PIPELINE_CHAOS_TRACE")
        self.pace = float(os.environ.get("PIPELINE_CHAOS_PACE") or 0)
        self.hits = {"train": 0, "save": 0, "setup": 0}


def point(phase: str, where: str) -> None:
    plan = _Plan()
    if plan.target is None and plan.trace is None and not plan.pace:
        return
    plan.hits[phase] += 1
    if plan.trace is not None:
        with open(plan.trace, "a") as f:
            f.write(f"{phase} {plan.hits[phase]} {where}\n")
    if plan.pace and phase in ("train", "setup"):
        time.sleep(plan.pace)  # after the trace: a test sees where the process is waiting
    if phase == plan.phase and plan.hits[phase] == plan.target:
        for sig in plan.send:
            os.kill(os.getpid(), sig)
