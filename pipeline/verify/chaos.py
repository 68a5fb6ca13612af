"""Chaos mode: SIGKILL the real command at random points in steps and saves, re-run it, demand bit-exactness."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from pipeline.checkpoint.directory import CheckpointDir, file_hashes
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.manifest import versions
from pipeline.checkpoint.store import CheckpointStore
from pipeline.config.compose import PROJECT_ROOT
from pipeline.config.errors import EXIT_BAD_INPUT as EXIT_INCOMPLETE
from pipeline.config.errors import EXIT_ERROR as EXIT_MISMATCH
from pipeline.config.errors import EXIT_OK
from pipeline.files import jsonio
from pipeline.files.atomic import remove_tree
from pipeline.run.directory import RunDir
from pipeline.verify.protocol import verify_dir


def _command(argv: list[str], output_dir: Path) -> list[str]:
    kept = [a for a in argv if not a.startswith(("verify.", "paths.output_dir="))]
    tail = [f"paths.output_dir={output_dir}", "hydra/job_logging=disabled"]
    return [sys.executable, "-m", "pipeline", *kept, *tail]


def run(cmd: list[str], kill: str | None = None, cwd=None, **env) -> subprocess.CompletedProcess:
    """`cmd` in a fresh process importing this project, SIGKILLed at kill point `kill` (files/killpoint.py) if given."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_CHAOS")}
    path = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**keep, "PYTHONPATH": path, **({"PIPELINE_CHAOS": kill} if kill else {}), **env}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def invalid_checkpoints(*stores: CheckpointStore) -> list[str]:
    """Why each checkpoint a reader of the stores sees does not verify (a temporary is no checkpoint)."""
    bad = []
    for directory in (d for store in stores for _, d in store.steps()):
        try:
            CheckpointDir(directory).load()
        except CheckpointError as e:
            bad.append(str(e))
    return bad


def invalid_visible_checkpoints(output_dir: Path) -> list[str]:
    """invalid_checkpoints of every run directory under `output_dir`."""
    return invalid_checkpoints(*(RunDir(run).store for run in (output_dir / "runs").glob("*")))


def metric_lines(run: Path) -> list[dict]:
    """The run's metrics.jsonl lines without their wall-clock time: what a bit-exact rerun repeats."""
    return [{k: v for k, v in ln.items() if k != "time"} for ln in RunDir(run).read_metrics()]


def final_state(output_dir: Path) -> dict:
    """What must be identical: every kept checkpoint's files (sha256) and links, the final state, every number."""
    runs = [p for p in (output_dir / "runs").iterdir() if p.is_dir()]
    if len(runs) != 1:
        where = output_dir / "runs"
        raise RuntimeError(f"expected one run directory under {where}, found {len(runs)}")
    store = RunDir(runs[0]).store
    kept = {step: file_hashes(CheckpointDir(d).load().manifest) for step, d in store.steps()}
    final = store.link_step("final")
    assert final is not None, f"{output_dir}: the run has no final checkpoint"
    _, extra = CheckpointDir(store.root / "final").json_state()
    out = {k: kept[final][k] for k in ("weights", "optim")} | {"extra": extra, "step": final}
    return out | {"metrics": metric_lines(runs[0]), "checkpoints": kept, "links": store.links()}


def trial(argv: list[str], out: Path, kill: str, reference: dict, max_reruns: int) -> dict:
    """One kill at `kill`, then the identical command until it completes, against the reference."""
    cmd = _command(argv, out)
    record: dict = {"killed": run(cmd, kill).returncode == -signal.SIGKILL}
    record["invalid_after_kill"] = invalid_visible_checkpoints(out)
    for reruns in range(1, max_reruns + 1):  # noqa: B007 - the count is read after the loop
        done = run(cmd)
        if done.returncode == 0:
            break
    record["reruns"], record["rerun_exit"] = reruns, done.returncode
    if done.returncode != 0:
        return {**record, "bit_exact": False, "error": done.stderr.strip()[-500:]}
    got, keys = final_state(out), ("weights", "optim", "extra", "metrics", "step")
    differ = [k for k in keys if got[k] != reference[k]]
    same = got["checkpoints"] == reference["checkpoints"] and got["links"] == reference["links"]
    return record | dict(bit_exact=not differ, mismatched=differ, same_checkpoints_kept=same)


def run_chaos(config: dict, argv: list[str]) -> int:
    v = config["verify"]
    out = verify_dir(config, "chaos")
    t0 = time.time()
    # The reference: the identical command, uninterrupted, counting the kill points it passes.
    trace = out / "reference.trace"
    ref = run(_command(argv, out / "reference"), PIPELINE_CHAOS_TRACE=str(trace))
    if ref.returncode != 0:
        tail = ref.stderr.strip()[-500:]
        print(f"chaos: the reference run failed (exit {ref.returncode}): {tail}")
        return EXIT_INCOMPLETE
    counts = Counter(line.split()[0] for line in trace.read_text().splitlines())
    reference = final_state(out / "reference")
    rng = random.Random(int(v["seed"]))
    trials: list[dict] = []
    for i in range(int(v["trials"])):
        phase = ("train", "save")[i] if i < 2 else rng.choice(("train", "save"))
        k = rng.randint(1, counts[phase])
        trial_dir = out / f"trial-{i:04d}"
        record = trial(argv, trial_dir, f"{phase}:{k}", reference, int(v["max_reruns"]))
        trials.append({"trial": i, "phase": phase, "point": k, **record})
        remove_tree(trial_dir)
    phases = dict.fromkeys(t["phase"] for t in trials)
    by_phase = Counter({p: sum(t["killed"] for t in trials if t["phase"] == p) for p in phases})
    exact = sum(t["bit_exact"] for t in trials)
    same_kept = sum(bool(t.get("same_checkpoints_kept")) for t in trials)
    invalid = [e for t in trials for e in t["invalid_after_kill"]]
    passed = exact == same_kept == len(trials) and not invalid and all(t["killed"] for t in trials)
    report: dict = dict(mode="chaos", trials=len(trials), bit_exact=exact, all_checks_passed=passed)
    report |= dict(kills_by_phase=dict(by_phase), kill_points_available=dict(counts))
    report |= dict(invalid_visible_checkpoints=invalid, same_checkpoints_kept=same_kept)
    report["command"] = " ".join(_command(argv, Path("<trial dir>")))
    report |= dict(seconds=round(time.time() - t0, 1), versions=versions(), trial_records=trials)
    (out / "verification.json").write_bytes(jsonio.dumps(report))
    n, kept = len(trials), f"{same_kept}/{len(trials)} kept the same checkpoints and links"
    what = f"kills by phase {dict(by_phase)}; {len(invalid)} invalid visible checkpoints; report"
    print(f"chaos: {exact}/{n} trials bit-exact, {kept}; {what} {out / 'verification.json'}")
    return EXIT_OK if passed else EXIT_MISMATCH
