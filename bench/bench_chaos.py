"""Chaos bench: >= 200 SIGKILL trials on kernodeck through the real command; prints the verifier's summary.

Run: python bench/bench_chaos.py [--trials 200] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args()
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="bench-chaos-"))
    cmd = [
        sys.executable,
        "-m",
        "pipeline.verify",
        "experiment=kernodeck",
        "tracking=none",
        "verify.kill=random",
        f"verify.trials={args.trials}",
        f"verify.seed={args.seed}",
        f"paths.output_dir={out}",
    ]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    (path,) = (out / "verify").glob("*/chaos/verification.json")
    report = json.loads(path.read_text())
    points = sorted({(t["phase"], t["point"]) for t in report["trial_records"]})
    print(r.stdout.strip())
    print(
        json.dumps(
            {
                "trials": report["trials"],
                "bit_exact": report["bit_exact"],
                "same_checkpoints_kept": report["same_checkpoints_kept"],
                "kills_by_phase": report["kills_by_phase"],
                "kill_points_available": report["kill_points_available"],
                "distinct_kill_points_hit": len(points),
                "invalid_visible_checkpoints": len(report["invalid_visible_checkpoints"]),
                "seconds": round(time.time() - t0, 1),
                "exit": r.returncode,
            }
        )
    )
    print("command:", " ".join(cmd[1:]))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
