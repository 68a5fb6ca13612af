"""What tracking costs, as ratios measured in one run (the machines are shared and noisy: compare ratios).

    python bench/bench_tracking.py [--repeats 3] [--server | --server-only]

1. The cost of `import mlflow` in a fresh interpreter, and the cold agent's own start (a fresh interpreter
   that imports the agent's store module and opens an existing store): medians of --repeats, minus an empty
   interpreter's start; both also beside 2 busy loops, for the contended case.
2. A single kernodeck job (`python -m pipeline experiment=kernodeck`), tracking=none against tracking=mlflow,
   alternating, each mlflow run with a cold tracking agent (the previous one gone) and the store existing.
   Target: mlflow <= none + (1: import) + 1 s.
3. A 4-job kernodeck sweep (`-m optimizer.lr=a,b,c,d`, basic launcher), each in a fresh output directory (a
   fresh store, made by the agent from its migrated template), tracking=mlflow against tracking=none.
   Target: <= 1.5x.
4. The same sweep beside 2 busy-looping processes (as `bench/bench_step.py --contend 2`), against its
   untracked twin under the same contention. Target: <= 1.5x.
5. `--server` (or `--server-only`: this case alone): the team setup, a PostgreSQL and an `mlflow server` on it
   started here on 127.0.0.1 (the tests' own, tests/mlflow_servers.py: needs the `test` extra and Debian's
   `postgresql`), the same 4-job sweep with tracking=server against tracking=none. Target: <= 1.5x; its lag
   is until the tracking agent is idle (every message handed to the server).
For every mlflow case, the lag from the command's return until the index is complete: every run ended (not
RUNNING, sweep parent included) and every metrics.jsonl point present, read from the sqlite file itself
(no mlflow here) every 20 ms. Target: <= the cold agent's start (1) + 2 s.
Everything runs as subprocesses under a temporary directory; the agents' idle timeout is shortened so
that a cold start can be waited for. The migrated template store is made once before the measurements
(once per machine and mlflow version, as in use).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IDLE = "2"  # seconds an idle agent lingers here
sys.path.insert(0, str(ROOT))
from bench_step import BusyLoops  # noqa: E402  the busy loops of bench_step.py --contend


def env() -> dict:
    e = {
        k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI")
    }
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
    from pipeline.tracking.link import socket_path

    deadline = time.monotonic() + 120
    while socket_path(uri).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def pipeline(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def run_dirs(out: Path) -> set[Path]:
    return {p for p in (out / "runs").iterdir() if p.is_dir()} if (out / "runs").is_dir() else set()


def index_complete(out: Path, before: set[Path]) -> bool:
    """Every run directory under `out` but those in `before` has an ended mlflow run holding each of its
    metrics.jsonl points, and every sweep parent has ended (read straight from the sqlite file)."""
    from pipeline.run.directory import RunDir
    from pipeline.tracking.common import metric_points

    db = out / "mlflow.db"
    if not db.exists():
        return False
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.5)
    except sqlite3.Error:
        return False
    try:
        runs = {
            d: (rid, status)
            for rid, status, d in con.execute(
                "SELECT r.run_uuid, r.status, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                "AND t.key = 'run_dir' WHERE r.lifecycle_stage = 'active'"
            )
        }
        parents = [
            s
            for (s,) in con.execute(
                "SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                "AND t.key = 'sweep' AND t.value = 'parent'"
            )
        ]
        if any(s == "RUNNING" for s in parents):
            return False
        for run_dir in run_dirs(out) - before:
            rid, status = runs.get(str(run_dir.resolve()), (None, "RUNNING"))
            if status == "RUNNING":
                return False
            want = {}
            for line in RunDir(run_dir).read_metrics():
                for key, _, _, step in metric_points(line):
                    want.setdefault(key, set()).add(step)
            have = dict(
                con.execute(
                    "SELECT key, COUNT(DISTINCT step) FROM metrics WHERE run_uuid = ? GROUP BY key",
                    (rid,),
                ).fetchall()
            )
            if any(have.get(k, 0) < len(steps) for k, steps in want.items()):
                return False
        return True
    except sqlite3.Error:  # locked or not made yet: not complete yet
        return False
    finally:
        con.close()


def lag(out: Path, before: set[Path], limit: float = 300.0) -> float:
    t0 = time.perf_counter()
    while not index_complete(out, before):
        if time.perf_counter() - t0 > limit:
            sys.exit(
                f"the index of {out} was not complete {limit:.0f} s after its command returned"
            )
        time.sleep(0.02)
    return time.perf_counter() - t0


def fmt(v: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in v)


def startup(cwd: Path, repeats: int, uri: str) -> tuple[float, float, float]:
    """(import mlflow, agent start, empty interpreter), medians, the first two less the third."""
    opener = f"from pipeline.tracking import store; store.open_store({uri!r})"
    empty = [timed([sys.executable, "-c", "pass"], cwd) for _ in range(repeats)]
    imports = [timed([sys.executable, "-c", "import mlflow"], cwd) for _ in range(repeats)]
    opens = [timed([sys.executable, "-c", opener], cwd) for _ in range(repeats)]
    base = statistics.median(empty)
    return statistics.median(imports) - base, statistics.median(opens) - base, base


def sweep_pair(work: Path, cwd: Path, repeats: int, tag: str) -> tuple[dict, list[float]]:
    walls, lags = {"none": [], "mlflow": []}, []
    for i in range(repeats):
        for tracking in ("none", "mlflow") if i % 2 == 0 else ("mlflow", "none"):
            target = work / f"sweep-{tag}-{tracking}-{i}"
            walls[tracking].append(
                timed(
                    pipeline(
                        "-m",
                        "experiment=kernodeck",
                        f"paths.output_dir={target}",
                        f"tracking={tracking}",
                        "trainer.progress_bar=false",
                        "optimizer.lr=0.01,0.02,0.03,0.04",
                    ),
                    cwd,
                )
            )
            if tracking == "mlflow":
                lags.append(lag(target, set()))
                wait_for_no_agent(f"sqlite:///{target}/mlflow.db")
    return walls, lags


def server_case(work: Path, cwd: Path, repeats: int) -> dict:
    """5.: the 4-job sweep reporting to an mlflow server on PostgreSQL, against tracking=none."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mlflow_servers import mlflow_server, postgres_instance, postgres_unavailable

    from pipeline.tracking.link import wait_idle

    if why := postgres_unavailable():
        sys.exit(why)
    root = work / "server"
    root.mkdir()
    t0 = time.perf_counter()
    with (
        postgres_instance() as db,
        mlflow_server(root, "--artifacts-destination", str(root / "artifacts"), backend=db) as uri,
    ):
        print(
            f"\n5. the team setup: PostgreSQL and mlflow server {uri} up in {time.perf_counter() - t0:.1f} s"
        )
        walls, lags = {"none": [], "server": []}, []
        for i in range(repeats):
            for tracking in ("none", "server") if i % 2 == 0 else ("server", "none"):
                target = work / f"sweep-server-{tracking}-{i}"
                extra = (
                    [f"tracking.uri={uri}", f"tracking.experiment=bench-{i}"]
                    if tracking == "server"
                    else []
                )
                wait_for_no_agent(uri)
                walls[tracking].append(
                    timed(
                        pipeline(
                            "-m",
                            "experiment=kernodeck",
                            f"paths.output_dir={target}",
                            f"tracking={tracking}",
                            *extra,
                            "trainer.progress_bar=false",
                            "optimizer.lr=0.01,0.02,0.03,0.04",
                        ),
                        cwd,
                    )
                )
                if tracking == "server":
                    t1 = time.perf_counter()
                    if not wait_idle(uri, 300):
                        sys.exit(f"the tracking agent of {uri} went away before it was idle")
                    lags.append(time.perf_counter() - t1)
    s_none, s_server = statistics.median(walls["none"]), statistics.median(walls["server"])
    print(
        f"   a 4-job kernodeck sweep, basic launcher, fresh output directory (median of {repeats}):"
    )
    print(
        "   command: python -m pipeline -m experiment=kernodeck paths.output_dir=<fresh> tracking=<none|server> "
        "[tracking.uri=http://127.0.0.1:PORT] trainer.progress_bar=false optimizer.lr=0.01,0.02,0.03,0.04"
    )
    for k, v in walls.items():
        print(f"   tracking={k:<6} {statistics.median(v):6.2f} s   ({fmt(v)})")
    print(
        f"   ratio server/none = {s_server / s_none:.2f}; target <= 1.5: "
        f"{'met' if s_server <= 1.5 * s_none else 'NOT met'}"
    )
    print(
        f"   tracking agent idle {statistics.median(lags):.2f} s after the command returned ({fmt(lags)})",
        flush=True,
    )
    return {**walls, "lag": lags}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--server",
        action="store_true",
        help="also 5.: the sweep against an mlflow server on PostgreSQL",
    )
    ap.add_argument("--server-only", action="store_true", help="5. alone")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    cwd = work / "cwd"
    cwd.mkdir()
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; scratch {work}", flush=True
    )
    busy = BusyLoops(2)
    results: dict = {"load_start": round(os.getloadavg()[0], 2)}
    try:
        if args.server_only:
            results["server"] = server_case(work, cwd, args.repeats)
            results["load_end"] = round(os.getloadavg()[0], 2)
            print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
            print(json.dumps(results))
            return
        t0 = time.perf_counter()
        timed(
            [
                sys.executable,
                "-c",
                "from pipeline.tracking import store; print(store.template_db())",
            ],
            cwd,
        )
        print(
            f"\n0. the migrated template store is ready ({time.perf_counter() - t0:.2f} s, made now if it was not)"
        )

        out = work / "single"
        job = ("experiment=kernodeck", f"paths.output_dir={out}", "trainer.progress_bar=false")
        timed(pipeline(*job, "trainer.seed=999"), cwd)  # the store exists from now on
        uri = f"sqlite:///{out}/mlflow.db"
        wait_for_no_agent(uri)
        import_cost, agent_start, base = startup(cwd, args.repeats, uri)
        busy.resume()
        c_import, c_agent_start, c_base = startup(cwd, args.repeats, uri)
        busy.pause()
        print(
            f"\n1. quiet: import mlflow {import_cost:.2f} s, cold agent start (import + open an existing store) "
            f"{agent_start:.2f} s (medians of {args.repeats}, less {base:.2f} s for `pass`)"
        )
        print(
            f"   beside 2 busy loops: import mlflow {c_import:.2f} s, cold agent start {c_agent_start:.2f} s "
            f"(less {c_base:.2f} s)",
            flush=True,
        )

        walls, lags = {"none": [], "mlflow": []}, []
        for i in range(args.repeats):
            for tracking in ("none", "mlflow") if i % 2 == 0 else ("mlflow", "none"):
                wait_for_no_agent(uri)
                before = run_dirs(out)
                walls[tracking].append(
                    timed(
                        pipeline(
                            *job, f"tracking={tracking}", f"trainer.seed={10 * i}", "resume=never"
                        ),
                        cwd,
                    )
                )
                if tracking == "mlflow":
                    lags.append(lag(out, before))
        none, mlflow = statistics.median(walls["none"]), statistics.median(walls["mlflow"])
        budget, lag_budget = none + import_cost + 1.0, agent_start + 2.0
        print(
            f"\n2. a single kernodeck job (median of {args.repeats}, cold agent, existing store):"
        )
        print(f"   command: python -m pipeline {' '.join(job)} tracking=<none|mlflow> resume=never")
        for k, v in walls.items():
            print(f"   tracking={k:<6} {statistics.median(v):6.2f} s   ({fmt(v)})")
        print(
            f"   mlflow - none = {mlflow - none:.2f} s; target <= import + 1 s = {import_cost + 1:.2f} s: "
            f"{'met' if mlflow <= budget else 'NOT met'}"
        )
        print(
            f"   index complete {statistics.median(lags):.2f} s after the command returned ({fmt(lags)}); "
            f"target <= agent start + 2 s = {lag_budget:.2f} s: "
            f"{'met' if statistics.median(lags) <= lag_budget else 'NOT met'}",
            flush=True,
        )
        results["single"] = {"none": walls["none"], "mlflow": walls["mlflow"], "lag": lags}

        for n, (tag, contended) in enumerate((("quiet", False), ("contended", True)), start=3):
            if contended:
                busy.resume()
            sweeps, lags = sweep_pair(work, cwd, args.repeats, tag)
            busy.pause()
            s_none, s_mlflow = (
                statistics.median(sweeps["none"]),
                statistics.median(sweeps["mlflow"]),
            )
            lag_budget = (c_agent_start if contended else agent_start) + 2.0
            print(
                f"\n{n}. a 4-job kernodeck sweep, basic launcher, fresh output directory (median of {args.repeats})"
                + (", beside 2 busy loops" if contended else "")
                + ":"
            )
            print(
                "   command: python -m pipeline -m experiment=kernodeck paths.output_dir=<fresh> "
                "tracking=<none|mlflow> trainer.progress_bar=false optimizer.lr=0.01,0.02,0.03,0.04"
            )
            for k, v in sweeps.items():
                print(f"   tracking={k:<6} {statistics.median(v):6.2f} s   ({fmt(v)})")
            print(
                f"   ratio mlflow/none = {s_mlflow / s_none:.2f}; target <= 1.5: "
                f"{'met' if s_mlflow <= 1.5 * s_none else 'NOT met'}"
            )
            print(
                f"   index complete {statistics.median(lags):.2f} s after the command returned ({fmt(lags)}); "
                f"target <= agent start + 2 s = {lag_budget:.2f} s: "
                f"{'met' if statistics.median(lags) <= lag_budget else 'NOT met'}",
                flush=True,
            )
            results[tag] = {**sweeps, "lag": lags}
        if args.server:
            results["server"] = server_case(work, cwd, args.repeats)
        results["load_end"] = round(os.getloadavg()[0], 2)
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
        print(json.dumps(results))
    finally:
        busy.close()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
