"""What tracking costs, as ratios measured in one run (the machines are shared and noisy: compare ratios).

    python bench/bench_tracking.py [--steps 600] [--repeats 2] [--sweep-steps 20] [--startup-runs 4] [--keep]

1. Start-up: process start to the first training step of the default model, with its corpus already generated,
   tracking=mlflow and tracking=none (mlflow's ~3.5 s import must not be on this path; target <= 1.5 s).
   The first step starts when the trainer creates metrics.jsonl (polled every 2 ms); it ends at the first line.
2. trainer.log_every=1 on the default model, tracking=mlflow vs tracking=none, alternating (target <= 3% slower):
   the training span (first to last metrics line, plus one step) and the whole process.
3. Four jobs (`-m trainer.seed=a,b,c,d`): hydra/launcher=joblib hydra.launcher.n_jobs=2 vs the basic launcher,
   whole command wall time, tracking=mlflow (target <= 0.6x), and tracking=none as a control.
Everything runs as `python -m pipeline ...` subprocesses under a temporary output directory. --priority idle
measures the mlflow runs with tracking.priority=idle (the agent only takes cycles training leaves idle).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    return e


def cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def show(argv: list[str]) -> str:
    return " ".join(["python" if a == sys.executable else a for a in argv])


def run(argv: list[str], cwd: Path, log: Path) -> float:
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(argv, cwd=cwd, env=env(), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"failed ({rc}): {show(argv)}\n{log.read_text()[-3000:]}")
    return time.time() - t0


def lines_of(path: Path) -> list[dict]:
    out = []
    for raw in path.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            break
    return out


PRIORITY: list[str] = []  # ["tracking.priority=..."] when --priority is given


def tracking_args(tracking: str) -> list[str]:
    return [f"tracking={tracking}", *(PRIORITY if tracking != "none" else [])]


def startup(out: Path, cwd: Path, tracking: str, seed: int) -> tuple[float, float]:
    """(s to the first step's start, s to its end) from process start; the process is preempted after 2 steps."""
    runs = out / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    argv = cmd(f"paths.output_dir={out}", *tracking_args(tracking), f"trainer.seed={seed}", "trainer.max_steps=3",
               "trainer.log_every=1", "trainer.progress_bar=false")
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines, deadline, started = [], time.monotonic() + 300, None
    while len(lines) < 2 and time.monotonic() < deadline and proc.poll() is None:
        new = [p for p in (set(runs.iterdir()) if runs.is_dir() else set()) - before]
        if new and (new[0] / "metrics.jsonl").exists():
            started = started or time.time()  # the trainer opens metrics.jsonl just before its first step
            lines = lines_of(new[0] / "metrics.jsonl")
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # preempt our own child: it checkpoints, flushes tracking, exits 75
    proc.wait()
    if len(lines) < 2:
        sys.exit(f"no two metrics lines from: {show(argv)}")
    return started - t0, lines[0]["time"] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="steps of the default model per log_every=1 run")
    ap.add_argument("--repeats", type=int, default=2, help="log_every=1 runs per tracking setting")
    ap.add_argument("--startup-runs", type=int, default=4, help="start-up measurements per tracking setting")
    ap.add_argument("--sweep-steps", type=int, default=20, help="steps per job of the 4-job sweeps")
    ap.add_argument("--priority", default=None, help="tracking.priority for the mlflow runs (default: the config's)")
    ap.add_argument("--sweep-args", default="", help="extra overrides for the sweeps (e.g. experiment=kernodeck "
                    "trainer.max_steps=2000 for single-threaded jobs)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: startup,logging,sweep")
    ap.add_argument("--keep", action="store_true", help="keep the temporary output directory")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.priority is not None:
        PRIORITY.append(f"tracking.priority={args.priority}")
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    out, cwd = work / "out", work / "cwd"
    cwd.mkdir(parents=True)
    print(f"output directory {out} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})", flush=True)
    results = []
    try:
        # Warm-up: the corpus is generated and the mlflow DB created, so neither is on the measured paths.
        run(cmd(f"paths.output_dir={out}", "trainer.max_steps=1", "trainer.seed=999"), cwd, work / "warmup.log")

        if "startup" not in skip:
            figures = {"none": [], "mlflow": []}
            for i in range(args.startup_runs):
                for tracking in (("none", "mlflow") if i % 2 == 0 else ("mlflow", "none")):
                    figures[tracking].append(startup(out, cwd, tracking, 1000 + 2 * i + (tracking == "mlflow")))
            print("\n1. process start -> first training step (default model, corpus present; median of "
                  f"{args.startup_runs}; target <= 1.5 s)")
            print(f"   command: {show(cmd(f'paths.output_dir={out}', 'tracking=<none|mlflow>', 'trainer.seed=<n>'))}")
            for tracking, xs in figures.items():
                s, e = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
                print(f"   tracking={tracking:<6}  step starts {s:5.2f} s   first step ends {e:5.2f} s   "
                      f"(all starts: {', '.join(f'{x[0]:.2f}' for x in xs)})")
            ratio = statistics.median(x[0] for x in figures["mlflow"]) / statistics.median(
                x[0] for x in figures["none"])
            print(f"   ratio mlflow/none (to the step's start): {ratio:.3f}", flush=True)
            results.append(("startup_s", statistics.median(x[0] for x in figures["mlflow"])))

        if "logging" not in skip:
            spans = {"none": [], "mlflow": []}
            walls = {"none": [], "mlflow": []}
            for i in range(args.repeats):
                for tracking in (("none", "mlflow") if i % 2 == 0 else ("mlflow", "none")):
                    argv = cmd(f"paths.output_dir={out}", *tracking_args(tracking), "trainer.log_every=1",
                               f"trainer.max_steps={args.steps}", "resume=never", "trainer.progress_bar=false")
                    time.sleep(1.1)  # resume=never names the run directory by the second
                    runs = out / "runs"
                    before = set(runs.iterdir())
                    walls[tracking].append(run(argv, cwd, work / f"log-{tracking}-{i}.log"))
                    (new,) = set(runs.iterdir()) - before
                    lines = lines_of(new / "metrics.jsonl")
                    step = statistics.median(b["time"] - a["time"] for a, b in zip(lines, lines[1:]))
                    spans[tracking].append(lines[-1]["time"] - lines[0]["time"] + step)
            span_ratio = statistics.median(spans["mlflow"]) / statistics.median(spans["none"])
            wall_ratio = statistics.median(walls["mlflow"]) / statistics.median(walls["none"])
            print(f"\n2. trainer.log_every=1, {args.steps} steps of the default model, tracking=mlflow vs none "
                  f"(median of {args.repeats}; target <= 1.03)")
            print(f"   command: {show(cmd(f'paths.output_dir={out}', 'tracking=<none|mlflow>', 'trainer.log_every=1', f'trainer.max_steps={args.steps}', 'resume=never'))}")
            for tracking in ("none", "mlflow"):
                print(f"   tracking={tracking:<6}  training {statistics.median(spans[tracking]):6.2f} s   "
                      f"process {statistics.median(walls[tracking]):6.2f} s   "
                      f"(training: {', '.join(f'{x:.2f}' for x in spans[tracking])})")
            print(f"   ratio mlflow/none: training {span_ratio:.3f}, whole process {wall_ratio:.3f}", flush=True)
            results.append(("log_every_1_training_ratio", span_ratio))

        if "sweep" not in skip:
            walls = {}
            variants = [(t, launcher, extra) for t in ("mlflow", "none")
                        for launcher, extra in (("basic", []), ("joblib", ["hydra/launcher=joblib",
                                                                           "hydra.launcher.n_jobs=2"]))]
            for k, (tracking, launcher, extra) in enumerate(variants):
                seeds = ",".join(str(2000 + 10 * k + j) for j in range(4))
                argv = cmd("-m", f"paths.output_dir={out}", *tracking_args(tracking),
                           f"trainer.max_steps={args.sweep_steps}", f"trainer.seed={seeds}",
                           "trainer.progress_bar=false", *args.sweep_args.split(), *extra)
                walls[tracking, launcher] = (run(argv, cwd, work / f"sweep-{tracking}-{launcher}.log"), argv)
            print(f"\n3. four jobs of {args.sweep_steps} steps of the default model: joblib n_jobs=2 vs the basic "
                  "launcher (target <= 0.6; tracking=none shows the launchers' own ratio)")
            for (tracking, launcher), (wall, argv) in walls.items():
                print(f"   {wall:6.2f} s   {show(argv)}")
            for tracking in ("mlflow", "none"):
                ratio = walls[tracking, "joblib"][0] / walls[tracking, "basic"][0]
                print(f"   ratio joblib/basic, tracking={tracking}: {ratio:.3f}", flush=True)
                results.append((f"joblib_over_basic_{tracking}", ratio))
        print("\nsummary: " + "  ".join(f"{k}={v:.3f}" for k, v in results))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
