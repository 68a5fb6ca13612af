"""`python -m pipeline.roundtrip [overrides]`: four checks of the checkpoint format on the composed config.

Each runs on fresh objects built from the config; results go to `<paths.output_dir>/roundtrip/<run name>/
roundtrip_results.json` (exit 0 if all pass, 1 if not, 2 on a bad override):

* byte equivalence: train N steps, save, load into fresh objects; every part (pipeline.stateful.PARTS) equal;
* continuation: 2N steps straight against N, save, and N more in a separate process that composes the same
  config and loads the checkpoint: bit-identical losses and every part of the state;
* weight tying: tied names stored once (header metadata `ALIAS(...)`), one object again after loading, and a
  weights file within 4 KiB of the unique parameters' bytes; without tied parameters `weight_tying_preserved`
  is null with a note, as "true" would claim a check that did not run;
* atomic write: a save SIGKILLed in a separate process just before its rename leaves no checkpoint, only a
  temporary that readers ignore and the next save removes.

`size_delta_pct` is the weights file's excess over the unique parameters' bytes (`expected_size_bytes_no_tying`,
a tied array counted once), for tiny models mostly the header (`weights_header_bytes`); `size_delta_note` says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipeline.checkpoint.directory import CheckpointDir, file_hashes, step_dir_name
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.manifest import SCHEMA_VERSION
from pipeline.checkpoint.store import CheckpointStore
from pipeline.checkpoint.tensors import read_tensors, write_tensors
from pipeline.config.compose import PROJECT_ROOT, compose, to_plain
from pipeline.config.errors import EXIT_ERROR, EXIT_OK
from pipeline.config.identity import run_name
from pipeline.files import jsonio
from pipeline.files.atomic import TMP_PREFIX, remove_tree, write_new
from pipeline.files.limits import MAX_CONTINUED
from pipeline.run.signals import command, run_command
from pipeline.stateful import PARTS, merge, split
from pipeline.verify.compare import first_difference
from pipeline.verify.worker import Fresh

SIZE_SLACK = 4096  # bytes the weights file may exceed the unique parameters by (its header)
RESULTS = "roundtrip_results.json"


# -- the objects and the weights file ------------------------------------------------------------


def losses(run: Fresh, n: int) -> list[float]:
    return [float(r["train/loss"]) for r in run.train(n)]


INTERRUPTED = "no results were written; re-run the same command"


def child(args: list[str], overrides: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python -m pipeline.roundtrip ARGS -- OVERRIDES` in a fresh process that imports this project."""
    path = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "pipeline.roundtrip", *args, "--", *overrides],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
    )


# -- the four checks ----------------------------------------------------------------------------


def check_byte_equivalence(config: dict, work: Path, steps: int) -> dict:
    run = Fresh(config)
    run.train(steps)
    before = run.snapshot()
    directory = work / "checkpoint" / step_dir_name(run.state.step)
    manifest = run.save(directory)
    fresh = Fresh(config)
    untouched = fresh.snapshot()
    fresh.load(directory)
    after = fresh.snapshot()
    differences = {m: d for m in PARTS if (d := first_difference(before[m], after[m], m))}
    return {
        "passed": [m for m in PARTS if m not in differences],
        "differences": differences,
        # a part the fresh objects already matched proves nothing about its restore
        "unchanged_by_training": [
            m for m in PARTS if first_difference(before[m], untouched[m], m) is None
        ],
        "directory": directory,
        "sha256": file_hashes(manifest)["weights"],
        "run": run,
    }


def check_continuation(
    config: dict, overrides: list[str], work: Path, steps: int, separate_process: bool = True
) -> dict:
    reference = Fresh(config)
    losses_ref = losses(reference, 2 * steps)
    first = Fresh(config)
    losses_a = losses(first, steps)
    directory = work / "continuation" / step_dir_name(first.state.step)
    first.save(directory)
    if separate_process:
        out = work / "continuation" / "resumed"
        proc = child(
            ["--continue-from", str(directory), "--steps", str(steps), "--out", str(out)], overrides
        )
        if proc.returncode != 0:
            return {
                "passed": False,
                "separate_process": True,
                "error": f"continuation process exited {proc.returncode}: {proc.stderr.strip()[-2000:]}",
            }
        arrays, _ = read_tensors(out / "continued.safetensors")
        losses_b = arrays.pop("losses").tolist()
        json_tree = jsonio.read(out / "continued.json", MAX_CONTINUED)
        resumed = merge(arrays, json_tree)
    else:
        second = Fresh(config)
        second.load(directory)
        losses_b = losses(second, steps)
        resumed = second.snapshot()
    checks = {
        "losses": first_difference(np.array(losses_ref), np.array(losses_a + losses_b), "losses"),
        "state": first_difference(reference.snapshot(), resumed),
    }
    return {
        "passed": all(v is None for v in checks.values()),
        "separate_process": separate_process,
        "steps": [steps, steps],
        "differences": {k: v for k, v in checks.items() if v},
    }


def run_continuation(overrides: list[str], checkpoint: Path, steps: int, out: Path) -> None:
    """The second half of the continuation check, in its own process: results as safetensors + JSON."""
    run = Fresh(to_plain(compose(overrides)))
    run.load(checkpoint)
    trained = losses(run, steps)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("continued.safetensors", "continued.json"):
        (out / name).unlink(missing_ok=True)
    arrays, json_tree = split(run.snapshot())
    write_tensors(out / "continued.safetensors", {**arrays, "losses": np.array(trained)})
    (out / "continued.json").write_bytes(jsonio.dumps(json_tree))


def check_tying(config: dict, d: dict) -> dict:
    model, directory = d["run"].state.model, d["directory"]
    live = model.state_dict()
    aliases = dict(model.aliases)
    expected = sum(
        a.nbytes for a in {id(a): a for a in live.values()}.values()
    )  # a tied array counted once
    path = CheckpointDir(directory).weights_file()
    size = path.stat().st_size
    with open(
        path, "rb"
    ) as f:  # the header read straight from the file, its bytes counting the 8-byte length
        (n,) = struct.unpack("<Q", f.read(8))
        header_bytes, head = 8 + n, jsonio.loads(f.read(n))
    metadata = head.get("__metadata__", {})
    extra = (
        size - expected
    )  # what size_delta_pct is relative to, and where the excess is, in words:
    where = (
        f"all {extra} of them its safetensors header"
        if extra == header_bytes
        else f"{header_bytes} of them its safetensors header, {extra - header_bytes} not"
    )
    out = {
        "weights_file_size_bytes": size,
        "expected_size_bytes_no_tying": expected,
        "weights_header_bytes": header_bytes,
        "size_delta_pct": round(100.0 * (size - expected) / expected, 4),
        "size_within_4kib": abs(size - expected) < SIZE_SLACK,
        "tied": aliases,
        "size_delta_note": f"relative to the unique parameters' {expected} bytes (a tied array counted once): "
        f"the weights file has {size}, {extra:+d} bytes, {where}",
    }
    if not aliases:
        out["weight_tying_preserved"] = None
        out["weight_tying_note"] = (
            "no tied weights in this model (model.aliases is empty): nothing to preserve"
        )
        return out
    fresh = Fresh(config)
    ckpt = fresh.load(directory)
    fresh_live = fresh.state.model.state_dict()
    loaded = ckpt.state["model"]
    checks = {
        "tied_before_save": all(live[a] is model.params[t] for a, t in aliases.items()),
        "header_alias": all(metadata.get(a) == f"ALIAS({t})" for a, t in aliases.items()),
        "stored_once": all(a not in head for a in aliases),
        "one_object_after_load": all(loaded[a] is loaded[t] for a, t in aliases.items()),
        "one_object_after_apply": all(
            fresh_live[a] is fresh.state.model.params[t] for a, t in aliases.items()
        ),
        "size_within_4kib": out["size_within_4kib"],
    }
    out["weight_tying_checks"] = checks
    out["weight_tying_preserved"] = all(checks.values())
    return out


def check_atomic(overrides: list[str], work: Path) -> dict:
    out = work / "atomic"
    args = ["--save-to", str(out), "--steps", "2"]
    killed = child(args, overrides, PIPELINE_CHAOS="save:4")
    interrupted = killed.returncode == -signal.SIGKILL
    parent = out / "saves"
    leftovers_after_kill = (
        sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP_PREFIX))
        if parent.is_dir()
        else []
    )
    no_final = (
        not any(p.name.startswith("step-") for p in parent.iterdir()) if parent.is_dir() else True
    )
    ignored = CheckpointStore(parent).steps() == []
    again = child(args, overrides)
    leftovers = sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP_PREFIX))
    try:
        CheckpointDir(parent / step_dir_name(2)).verify()
        verifies = True
    except CheckpointError:
        verifies = False
    checks = {
        "interrupted": interrupted,
        "no_final_directory": no_final,
        "temporary_left": bool(leftovers_after_kill),
        "readers_ignore_temporary": ignored,
        "next_save_cleans_up": again.returncode == 0 and not leftovers,
        "next_save_verifies": verifies,
    }
    return {"passed": all(checks.values()), "checks": checks, "leftovers": leftovers}


# -- the command --------------------------------------------------------------------------------


def roundtrip(
    overrides: list[str], steps: int = 10, separate_process: bool = True, keep: bool = False
) -> tuple[dict, Path]:
    config = to_plain(compose(overrides))
    out = Path(config["paths"]["output_dir"]) / "roundtrip" / run_name(config)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("checkpoint", "manifest.json", RESULTS):
        remove_tree(out / old)  # a link is removed, never followed
    scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=out))
    try:
        d = check_byte_equivalence(config, out, steps)
        name, raw = CheckpointDir(d["directory"]).manifest_file()
        manifest = jsonio.loads(raw)
        write_new(out / name, raw)
        tying = check_tying(config, d)
        continuation = check_continuation(config, overrides, scratch, steps, separate_process)
        atomic = check_atomic(overrides, scratch)
    finally:
        if not keep:
            remove_tree(scratch)
    results = {
        **tying,  # the weights file's size against the unique parameters' (and why), the tying checks
        "byte_equivalent_state_machines": d["passed"],
        "all_byte_equal": len(d["passed"]) == len(PARTS),
        "continuation_test_passed": continuation["passed"],
        "atomic_write_resilient": atomic["passed"],
        "manifest_schema_version": manifest.get("schema_version"),
        "state_differences": d["differences"],
        "unchanged_by_training": d["unchanged_by_training"],
        "continuation": continuation,
        "atomic": atomic,
        "checkpoint": str(d["directory"]),
        "checkpoint_sha256": d["sha256"],
        "steps": steps,
        "overrides": list(overrides),
    }
    results["passed"] = bool(
        results["all_byte_equal"]
        and results["continuation_test_passed"]
        and results["weight_tying_preserved"] is not False
        and results["atomic_write_resilient"]
        and results["size_within_4kib"]
        and results["manifest_schema_version"] == SCHEMA_VERSION
    )
    path = out / RESULTS
    path.write_bytes(jsonio.dumps(results))
    return results, path


@command("pipeline.roundtrip")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.roundtrip", description=__doc__.splitlines()[0]
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m pipeline")
    ap.add_argument(
        "--steps",
        type=int,
        default=10,
        help="steps before the checkpoint, and after it (default 10)",
    )
    ap.add_argument(
        "--in-process", action="store_true", help="continue in this process instead of a fresh one"
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the scratch directories of the checks"
    )
    ap.add_argument(
        "--continue-from", type=Path, help=argparse.SUPPRESS
    )  # the continuation's child process
    ap.add_argument(
        "--save-to", type=Path, help=argparse.SUPPRESS
    )  # the atomic check's child process
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_intermixed_args(argv)  # options may come between the overrides
    if args.continue_from is not None:
        run_continuation(args.overrides, args.continue_from, args.steps, args.out)
        return EXIT_OK
    if args.save_to is not None:
        run = Fresh(to_plain(compose(args.overrides)))
        run.train(args.steps)
        run.save(args.save_to / "saves" / step_dir_name(run.state.step))
        return EXIT_OK
    to_plain(compose(args.overrides))  # a bad override: one line, exit 2 (config/errors.exit_code)
    results, path = roundtrip(args.overrides, args.steps, not args.in_process, args.keep)
    notes = {
        "weight_tying_preserved": results.get("weight_tying_note"),
        "size_delta_pct": results["size_delta_note"],
    }
    for key in (
        "byte_equivalent_state_machines",
        "all_byte_equal",
        "continuation_test_passed",
        "weight_tying_preserved",
        "atomic_write_resilient",
        "weights_file_size_bytes",
        "expected_size_bytes_no_tying",
        "size_delta_pct",
        "manifest_schema_version",
    ):
        note = f"  # {notes[key]}" if notes.get(key) else ""
        print(f"{key}: {jsonio.dumps_line(results[key])}{note}")
    print(f"{'PASS' if results['passed'] else 'FAIL'}: {path}")
    return EXIT_OK if results["passed"] else EXIT_ERROR


if __name__ == "__main__":
    run_command("pipeline.roundtrip", main, INTERRUPTED)
