"""What a run says at its start (model, data, run directory) and its end (best, checkpoints, next commands)."""
from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from pathlib import Path

from pipeline.model.base import summary


def start_block(job, run_dir: Path) -> str:
    """The model's parameters per group (a tied alias noted, never counted twice), the data's size, the run."""
    model, data = job.state.model, job.state.dataset
    rows, total = summary(model.params, getattr(model, "aliases", {}))
    width = max([len(r[0]) for r in rows] + [5])
    lines = [f"model {type(model).__name__}: {total:,} parameters"
             + (" (tied: counted once)" if getattr(model, "aliases", None) else "")]
    lines.append(f"  {'group':<{width}}  {'arrays':>6}  {'params':>10}  shape")
    for group, shapes, n, note in rows:
        biggest = "x".join(map(str, max(shapes, key=math.prod))) if shapes else "-"
        lines.append(f"  {group:<{width}}  {len(shapes):>6}  {n:>10,}  {biggest}{'  ' + note if note else ''}")
    spec = data.spec
    if spec.vocab_size:
        what = (f"{data.n_train:,} train windows, {getattr(data, 'n_val', 0):,} val windows of {spec.block_size} "
                f"tokens, vocab {spec.vocab_size:,}")
    else:
        what = f"{data.n_train:,} train rows, {spec.n_features} features -> {spec.n_targets} targets"
    lines.append(f"data {type(data).__name__}: {what}")
    lines.append(f"run directory {run_dir}")
    return "\n".join(lines)


def end_block(*, status: str, step: int, run_dir: Path, best: tuple | None, links: dict[str, Path | None],
              curve: Path | None, run_uri: str | None, tracking_uri: str | None, overrides: list[str],
              samples: bool) -> str:
    """At most 12 lines: where the run ended, its `best` (monitor, value, step), checkpoints (`links`: final,
    best, newest -> a directory or None), curve, index, and the next commands."""
    py, found = sys.executable or "python", shutil.which("python")  # `python` if that is the one on PATH
    if os.path.basename(py) == "python" and found is not None and os.path.realpath(found) == os.path.realpath(py):
        py = "python"
    lines = [f"{status} at step {step}: {run_dir}"]
    if best is not None:
        lines.append(f"  best        {best[0]}={best[1]:.6g} at step {best[2]}")
    ckpts = [f"{k}={Path(os.path.realpath(v)).name}" for k, v in links.items() if v is not None]
    root = next((Path(v).parent for v in links.values() if v is not None), None)
    lines.append(f"  checkpoints {root}/: {' '.join(ckpts)}" if ckpts else "  checkpoints none")
    lines.append(f"  curve       {curve if curve else 'none (nothing logged)'}")
    lines.append(f"  mlflow      {run_uri or ('not indexed yet' if tracking_uri else 'not tracked')}")
    lines.append(f"  resume      {shlex.join([py, '-m', 'pipeline', *overrides])}")  # complete: says so, exits 0
    target = links.get("best") or links.get("final") or links.get("newest")
    if target is not None:
        lines.append(f"  evaluate    {shlex.join([py, '-m', 'pipeline.evaluate', str(target)])}")
        if samples:
            lines.append(f"  sample      {shlex.join([py, '-m', 'pipeline.sample', str(target)])} prompt=\"\"")
    if tracking_uri:
        lines.append(f"  mlflow ui   {shlex.join(['mlflow', 'ui', '--backend-store-uri', tracking_uri])}")
    return "\n".join(lines)
