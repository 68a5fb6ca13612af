"""Seed 003's protocol in four fresh processes: continuous, interrupted, full resume, resume without RNG."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

from pipeline.checkpoint.manifest import versions
from pipeline.config.errors import EXIT_BAD_INPUT as EXIT_INCOMPLETE
from pipeline.config.errors import EXIT_ERROR as EXIT_MISMATCH
from pipeline.config.errors import EXIT_OK, ConfigError
from pipeline.config.identity import run_name
from pipeline.files import jsonio
from pipeline.files.atomic import remove_tree
from pipeline.verify.compare import compare, machine
from pipeline.verify.snapshot import read_summary

MODES = ("continuous", "interrupted", "resume", "negative")


def verify_dir(config: dict, *sub: str) -> Path:
    """<output_dir>/verify/<run name>/<sub>, made afresh (an earlier verification's files removed)."""
    out = Path(config["paths"]["output_dir"]).joinpath("verify", run_name(config), *sub)
    remove_tree(out)  # a link is removed, never followed
    out.mkdir(parents=True)
    return out


def run_workers(
    config: dict, out: Path, cut: int, steps: int, overrides=(), modes=MODES, in_process=False
) -> tuple[list[list[str]], str | None]:
    """(commands, error) of the workers of `modes`, two processes at a time (or in this one), with `overrides`."""
    (config_path := out / "config.json").write_bytes(jsonio.dumps(config))
    ckpt = out / "interrupted" / "checkpoint"
    batches = [[m for m in pair if m in modes] for pair in (MODES[:2], MODES[2:])]
    commands = {
        mode: [sys.executable, "-m", "pipeline.verify.worker", "--config", str(config_path)]
        + ["--mode", mode, "--cut", str(cut), "--steps", str(steps), "--out", str(out / mode)]
        + (["--checkpoint", str(ckpt)] if mode in MODES[2:] else [])
        + [f"--override={o}" for o in overrides]
        for mode in modes
    }
    for batch in batches:
        if in_process:
            from pipeline.verify.worker import work

            for mode in batch:
                work(config, mode, cut, steps, out / mode, ckpt)
            continue
        procs = [subprocess.Popen(commands[m], stdout=PIPE, stderr=PIPE, text=True) for m in batch]
        for mode, p in zip(batch, procs, strict=True):
            _, err = p.communicate()
            if p.returncode != 0:
                tail = (err.strip().splitlines() or ["(no output)"])[-1]
                return list(commands.values()), f"{mode} process exited {p.returncode}: {tail}"
    return list(commands.values()), None


def _worst_weight(results: dict[str, dict]) -> float | None:
    values = [r["max_abs_diff"] for k, r in results.items() if k.startswith("model/")]
    return max((v for v in values if v is not None), default=None)


def verdict(out: Path, cut: int, steps: int, atol: float, rtol: float) -> dict:
    """The verification report from the four summaries on disk."""
    summaries = [read_summary(out / mode) for mode in MODES]
    (cont, cont_meta), (intr, intr_meta), (res, _), (neg, _) = summaries
    # The continuous run's per-update records after the cut line up with the resumed runs' records.
    cont = {k: v[cut:] if k.startswith("records/") else v for k, v in cont.items()}
    pos, negc = compare(cont, res, atol, rtol), compare(cont, neg, atol, rtol)
    comparisons = []
    for key in sorted(pos):
        p, n = pos[key], negc[key]
        row = dict(name=key, state_machine=machine(key), detail=p["detail"] or n["detail"])
        row |= dict(positive_max_abs_diff=p["max_abs_diff"], positive_agrees=p["ok"])
        row |= dict(negative_max_abs_diff=n["max_abs_diff"], negative_diverges=not n["ok"])
        comparisons.append(row)
    # Restored state at the cut against the interrupted process's state at the cut: names the culprit.
    restored, _ = read_summary(out / "resume", "restored")
    intr_state = {k: v for k, v in intr.items() if not k.startswith("records/")}
    at_cut = compare(intr_state, restored, atol, rtol)
    restore_failures = sorted({machine(k) for k, r in at_cut.items() if not r["ok"]})
    drifted = sorted({c["state_machine"] for c in comparisons if not c["positive_agrees"]})
    positive = not drifted and not restore_failures
    # The negative control counts only if the run itself went elsewhere: its streams' next draws always
    # differ (they were not restored), which alone proves nothing about the trajectory.
    negative = any(c["negative_diverges"] for c in comparisons if c["state_machine"] != "rng")
    # If no stream moved between the cut and the end, skipping the RNG restore cannot change anything.
    rng_moved = intr_meta["rng_states"] != cont_meta["rng_states"]
    runs = {"continuous": cont, "resume": res, "negative": neg}
    eval_loss = {name: float(run["eval/losses"].mean()) for name, run in runs.items()}
    at_cut_rows = [{"name": k, "state_machine": machine(k), **r} for k, r in at_cut.items()]
    report: dict = dict(positive=positive, negative_divergence_detected=negative, cut=cut)
    report |= dict(steps=steps, all_checks_passed=positive and negative, final_eval_loss=eval_loss)
    mode = "allclose" if atol or rtol else "exact (the same bytes)"
    report["tolerance"] = {"atol": atol, "rtol": rtol, "mode": mode}
    report["cursor_at_cut"] = f"{intr_meta['cursor']}/{intr_meta['n_train']}"
    report["epoch_at_cut"] = intr_meta["epoch"]
    report["next_lr"] = {name: float(run["scheduler/next_lr"][0]) for name, run in runs.items()}
    report["max_weight_diff"] = {"positive": _worst_weight(pos), "negative": _worst_weight(negc)}
    sides = (("positive", "resume"), ("negative", "negative"))
    report["eval_loss_diff"] = {s: abs(eval_loss["continuous"] - eval_loss[n]) for s, n in sides}
    report["failed_state_machines"] = sorted(set(drifted) | set(restore_failures))
    report |= dict(restore_failures=restore_failures, comparisons=comparisons, versions=versions())
    report["restored_at_cut"] = at_cut_rows
    failed = ", ".join(report["failed_state_machines"])
    if not positive:
        report["reason"] = f"the resumed run differs from the continuous one in: {failed}"
    elif not negative and rng_moved:
        report["reason"] = "the negative control did not diverge although streams moved"
    elif not negative:
        why = "no random stream draws after the cut (this config uses no randomness there, so "
        why += "skipping the RNG restore changes nothing: add dropout or data augmentation, "
        why += "or move verify.cut before an epoch's shuffle)"
        report["reason"] = f"the negative control cannot diverge: {why}"
    return report


def run_protocol(config: dict, argv: list[str]) -> int:
    v = config["verify"]
    cut, steps, atol, rtol = int(v["cut"]), int(v["steps"]), float(v["atol"]), float(v["rtol"])
    if not 0 < cut < steps:
        raise ConfigError(f"verify.cut must be in (0, verify.steps={steps}), got {cut}")
    out = verify_dir(config)
    t0 = time.time()
    commands, error = run_workers(config, out, cut, steps, argv)
    if error is None:
        try:
            report = verdict(out, cut, steps, atol, rtol)
        except (OSError, KeyError, ValueError) as e:
            error = f"could not read the summaries: {e}"
    if error is not None:
        report = dict(all_checks_passed=False, positive=None, negative_divergence_detected=None)
        report.update(reason=error, tolerance={"atol": atol, "rtol": rtol}, versions=versions())
    report["commands"] = [" ".join(c) for c in [["python -m pipeline.verify", *argv], *commands]]
    report["seconds"] = round(time.time() - t0, 2)
    (out / "verification.json").write_bytes(jsonio.dumps(report))
    print_report(report, out)
    return EXIT_INCOMPLETE if error else EXIT_OK if report["all_checks_passed"] else EXIT_MISMATCH


def print_report(report: dict, out: Path) -> None:
    if report.get("positive") is None:
        print(f"verification could not complete: {report['reason']}")
    else:
        mw, ed = report["max_weight_diff"], report["eval_loss_diff"]
        print(f"{'':28}{'full resume':>16}{'no RNG restore':>18}")
        print(f"{'max weight difference':28}{mw['positive']:>16.6g}{mw['negative']:>18.6g}")
        print(f"{'eval loss difference':28}{ed['positive']:>16.6g}{ed['negative']:>18.6g}")
        agrees = "agrees" if report["positive"] else "DIFFERS"
        diverges = "diverges" if report["negative_divergence_detected"] else "DOES NOT DIVERGE"
        print(f"{'verdict':28}{agrees:>16}{diverges:>18}")
        lr, at = report["next_lr"], f"cursor at cut {report['cursor_at_cut']}"
        print(f"{at}, next lr {lr['continuous']:.6g} (continuous) / {lr['resume']:.6g} (resume)")
        if "reason" in report:
            print(f"FAILED: {report['reason']}")
    print(f"report: {out / 'verification.json'}")
