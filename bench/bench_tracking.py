"""What tracking costs, as ratios measured in one run (the machines are shared and noisy: compare ratios).

    python bench/bench_tracking.py [--repeats 3]

1. The cost of `import mlflow` in a fresh interpreter (median of --repeats, minus an empty interpreter's start).
2. A single kernodeck job (`python -m pipeline experiment=kernodeck`), tracking=none against tracking=mlflow,
   alternating, each mlflow run with a cold tracking agent (the previous one gone) and the store existing.
   Target: mlflow <= none + (1) + 1 s.
3. A 4-job kernodeck sweep (`-m optimizer.lr=a,b,c,d`, basic launcher), each in a fresh output directory (a
   fresh store: created and migrated by the sweep), tracking=mlflow against tracking=none. Target: <= 1.5x.
Everything runs as subprocesses under a temporary directory; the agents' idle timeout is shortened so
that a cold start can be waited for.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IDLE = "2"  # seconds an idle agent lingers here


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e["PIPELINE_TRACKING_AGENT_IDLE"] = IDLE
    return e


def timed(argv: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(argv)}\n{(r.stdout + r.stderr)[-3000:]}")
    return time.perf_counter() - t0


def wait_for_no_agent(uri: str) -> None:
    sys.path.insert(0, str(ROOT))
    from pipeline.tracking.link import socket_path

    deadline = time.monotonic() + 120
    while socket_path(uri).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def pipeline(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    cwd = work / "cwd"
    cwd.mkdir()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; scratch {work}", flush=True)
    try:
        empty = [timed([sys.executable, "-c", "pass"], cwd) for _ in range(args.repeats)]
        imports = [timed([sys.executable, "-c", "import mlflow"], cwd) for _ in range(args.repeats)]
        import_cost = statistics.median(imports) - statistics.median(empty)
        print(f"\n1. import mlflow: {import_cost:.2f} s (median of {args.repeats}: "
              f"{', '.join(f'{t:.2f}' for t in imports)} s, minus {statistics.median(empty):.2f} s for `pass`)")

        out = work / "single"
        job = ("experiment=kernodeck", f"paths.output_dir={out}", "trainer.progress_bar=false")
        timed(pipeline(*job, "trainer.seed=999"), cwd)  # the store exists from now on
        uri = f"sqlite:///{out}/mlflow.db"
        walls = {"none": [], "mlflow": []}
        for i in range(args.repeats):
            for tracking in (("none", "mlflow") if i % 2 == 0 else ("mlflow", "none")):
                wait_for_no_agent(uri)
                walls[tracking].append(timed(pipeline(*job, f"tracking={tracking}", f"trainer.seed={10 * i}",
                                                      "resume=never"), cwd))
        none, mlflow = statistics.median(walls["none"]), statistics.median(walls["mlflow"])
        budget = none + import_cost + 1.0
        print(f"\n2. a single kernodeck job (median of {args.repeats}, cold agent, existing store):")
        print(f"   command: python -m pipeline {' '.join(job)} tracking=<none|mlflow> resume=never")
        for k, v in walls.items():
            print(f"   tracking={k:<6} {statistics.median(v):6.2f} s   ({', '.join(f'{t:.2f}' for t in v)})")
        print(f"   mlflow - none = {mlflow - none:.2f} s; target <= import + 1 s = {import_cost + 1:.2f} s: "
              f"{'met' if mlflow <= budget else 'NOT met'}", flush=True)

        sweeps = {"none": [], "mlflow": []}
        for i in range(args.repeats):
            for tracking in (("none", "mlflow") if i % 2 == 0 else ("mlflow", "none")):
                target = work / f"sweep-{tracking}-{i}"
                sweeps[tracking].append(timed(pipeline("-m", "experiment=kernodeck", f"paths.output_dir={target}",
                                                       f"tracking={tracking}", "trainer.progress_bar=false",
                                                       "optimizer.lr=0.01,0.02,0.03,0.04"), cwd))
                wait_for_no_agent(f"sqlite:///{target}/mlflow.db")
        s_none, s_mlflow = statistics.median(sweeps["none"]), statistics.median(sweeps["mlflow"])
        print(f"\n3. a 4-job kernodeck sweep, basic launcher, fresh output directory (median of {args.repeats}):")
        print("   command: python -m pipeline -m experiment=kernodeck paths.output_dir=<fresh> tracking=<none|mlflow> "
              "optimizer.lr=0.01,0.02,0.03,0.04")
        for k, v in sweeps.items():
            print(f"   tracking={k:<6} {statistics.median(v):6.2f} s   ({', '.join(f'{t:.2f}' for t in v)})")
        print(f"   ratio mlflow/none = {s_mlflow / s_none:.2f}; target <= 1.5: "
              f"{'met' if s_mlflow <= 1.5 * s_none else 'NOT met'}")
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
