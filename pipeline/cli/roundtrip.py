"""`python -m pipeline.roundtrip [overrides]`: four checks of the checkpoint format on the composed config.

Results in `<output_dir>/roundtrip/<run name>/roundtrip_results.json`; checks and exits: docs/checkpoints.md."""

from __future__ import annotations

import argparse
import signal
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipeline.checkpoint.directory import CheckpointDir, file_hashes, step_dir_name
from pipeline.checkpoint.manifest import SCHEMA_VERSION
from pipeline.checkpoint.store import CheckpointStore
from pipeline.cli import parser, temporaries
from pipeline.config.compose import compose, to_plain
from pipeline.config.errors import EXIT_ERROR, EXIT_OK
from pipeline.config.identity import run_name
from pipeline.files import jsonio
from pipeline.files.atomic import remove_tree, write_new
from pipeline.run.signals import command, run_command
from pipeline.stateful import PARTS
from pipeline.verify.chaos import invalid_checkpoints, run
from pipeline.verify.compare import first_difference
from pipeline.verify.protocol import MODES, run_workers
from pipeline.verify.snapshot import read_state, read_summary
from pipeline.verify.worker import Fresh

NAME = "pipeline.roundtrip"
SIZE_SLACK = 4096  # bytes the weights file may exceed the unique parameters by (its header)
RESULTS = "roundtrip_results.json"
INTERRUPTED = "no results were written; re-run the same command"


def check_byte_equivalence(config: dict, work: Path, steps: int) -> tuple[dict, Fresh, Path]:
    """Train, save, load into fresh objects: (results: which parts are equal, which are as built), run, directory."""
    run = Fresh(config)
    run.train(steps)
    before = run.snapshot()
    directory = work / "checkpoint" / step_dir_name(run.state.step)
    manifest = run.save(directory)
    fresh = Fresh(config)
    built = fresh.snapshot()
    fresh.load(directory)
    after = fresh.snapshot()
    differences = {m: d for m in PARTS if (d := first_difference(before[m], after[m], m))}
    out: dict = {"byte_equivalent_state_machines": [m for m in PARTS if m not in differences]}
    out |= {"all_byte_equal": not differences, "state_differences": differences}
    # a part the fresh objects already matched proves nothing about its restore
    out["unchanged_by_training"] = [m for m in PARTS if not first_difference(before[m], built[m])]
    out |= {"checkpoint": str(directory), "checkpoint_sha256": file_hashes(manifest)["weights"]}
    return out, run, directory


def check_continuation(config: dict, overrides: list[str], work: Path, steps: int, separate=True):
    """The verifier's continuous, interrupted and resumed workers cut at `steps`: the same losses, the same state."""
    out = work / "continuation"
    out.mkdir()
    modes = MODES[:3]
    _, error = run_workers(config, out, steps, 2 * steps, overrides, modes, not separate)
    if error is not None:
        return {"passed": False, "separate_process": separate, "error": error}
    (ref, _), (a, _), (b, _) = (read_summary(out / mode) for mode in modes)
    resumed = np.concatenate([a["records/loss"], b["records/loss"]])
    losses = first_difference(ref["records/loss"], resumed, "losses")
    state = first_difference(read_state(out / "continuous"), read_state(out / "resume"))
    differences = {k: v for k, v in (("losses", losses), ("state", state)) if v}
    result = {"passed": not differences, "separate_process": separate, "steps": [steps, steps]}
    return {**result, "differences": differences}


def check_tying(config: dict, run: Fresh, directory: Path) -> dict:
    """The weights file's size against the unique parameters' (and why); tied names stored once, tied again."""
    model = run.state.model
    live, aliases = model.state_dict(), dict(model.aliases)
    expected = sum(a.nbytes for a in {id(a): a for a in live.values()}.values())  # tied: once
    path = CheckpointDir(directory).weights_file()
    size = path.stat().st_size
    # the header read straight from the file, its bytes counting the 8-byte length
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header_bytes, head = 8 + n, jsonio.loads(f.read(n))
    metadata = head.get("__metadata__", {})
    extra = size - expected
    where = f"{header_bytes} of them its safetensors header, {extra - header_bytes} not"
    where = f"all {extra} of them its safetensors header" if extra == header_bytes else where
    out = dict(weights_file_size_bytes=size, expected_size_bytes_no_tying=expected, tied=aliases)
    out |= dict(weights_header_bytes=header_bytes, size_within_4kib=abs(extra) < SIZE_SLACK)
    out["size_delta_pct"] = round(100.0 * extra / expected, 4)
    note = f"relative to the unique parameters' {expected} bytes (a tied array counted once): the weights"
    out["size_delta_note"] = f"{note} file has {size}, {extra:+d} bytes, {where}"
    if not aliases:
        note = "no tied weights in this model (model.aliases is empty): nothing to preserve"
        return {**out, "weight_tying_preserved": None, "weight_tying_note": note}
    fresh = Fresh(config)
    loaded = fresh.load(directory).state["model"]
    fresh_live, params = fresh.state.model.state_dict(), fresh.state.model.params
    checks = {
        "tied_before_save": all(live[a] is model.params[t] for a, t in aliases.items()),
        "header_alias": all(metadata.get(a) == f"ALIAS({t})" for a, t in aliases.items()),
        "stored_once": all(a not in head for a in aliases),
        "one_object_after_load": all(loaded[a] is loaded[t] for a, t in aliases.items()),
        "one_object_after_apply": all(fresh_live[a] is params[t] for a, t in aliases.items()),
        "size_within_4kib": out["size_within_4kib"],
    }
    return {**out, "weight_tying_checks": checks, "weight_tying_preserved": all(checks.values())}


def check_atomic(overrides: list[str], work: Path) -> dict:
    """A save SIGKILLed before its rename: no checkpoint, a temporary readers ignore and the next save removes."""
    out = work / "atomic"
    cmd = [sys.executable, "-m", NAME, "--save-to", str(out), "--steps", "2", "--", *overrides]
    store = CheckpointStore(out / "saves")

    killed = run(cmd, "save:4").returncode == -signal.SIGKILL
    checks = dict(interrupted=killed, temporary_left=bool(temporaries(store.root)))
    checks["no_final_directory"] = not store.root.is_dir() or not any(store.root.glob("step-*"))
    checks["readers_ignore_temporary"] = store.steps() == []
    again, leftovers = run(cmd), temporaries(store.root)
    checks["next_save_cleans_up"] = again.returncode == 0 and not leftovers
    verifies = [s for s, _ in store.steps()] == [2] and not invalid_checkpoints(store)
    checks["next_save_verifies"] = verifies
    return {"passed": all(checks.values()), "checks": checks, "leftovers": leftovers}


def roundtrip(overrides: list, steps=10, separate_process=True, keep=False) -> tuple[dict, Path]:
    config = to_plain(compose(overrides))
    out = Path(config["paths"]["output_dir"]) / "roundtrip" / run_name(config)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("checkpoint", "manifest.json", RESULTS):
        remove_tree(out / old)  # a link is removed, never followed
    scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=out))
    try:
        equal, run, directory = check_byte_equivalence(config, out, steps)
        name, raw = CheckpointDir(directory).manifest_file()
        write_new(out / name, raw)
        tying = check_tying(config, run, directory)
        continuation = check_continuation(config, overrides, scratch, steps, separate_process)
        atomic = check_atomic(overrides, scratch)
    finally:
        if not keep:
            remove_tree(scratch)
    results = {**tying, **equal, "continuation": continuation, "atomic": atomic, "steps": steps}
    results |= dict(continuation_test_passed=continuation["passed"], overrides=list(overrides))
    results["atomic_write_resilient"] = atomic["passed"]
    results["manifest_schema_version"] = version = jsonio.loads(raw).get("schema_version")
    passed = [continuation["passed"], atomic["passed"], version == SCHEMA_VERSION]
    passed += [results["all_byte_equal"], results["size_within_4kib"]]
    results["passed"] = all(passed) and results["weight_tying_preserved"] is not False
    (path := out / RESULTS).write_bytes(jsonio.dumps(results))
    return results, path


# The lines printed, lab 02's seed fields in its order
SHOWN = """byte_equivalent_state_machines all_byte_equal continuation_test_passed weight_tying_preserved
atomic_write_resilient weights_file_size_bytes expected_size_bytes_no_tying size_delta_pct
manifest_schema_version""".split()  # noqa: SIM905


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    ap = parser(NAME, __doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m pipeline")
    steps = "steps before and after the checkpoint (default 10)"
    ap.add_argument("--steps", type=int, default=10, help=steps)
    ap.add_argument("--in-process", action="store_true", help="continue in this process")
    ap.add_argument("--keep", action="store_true", help="keep the checks' scratch directories")
    ap.add_argument("--save-to", type=Path, help=argparse.SUPPRESS)  # the atomic check's process
    args = ap.parse_intermixed_args(argv)  # options may come between the overrides
    if args.save_to is not None:
        run = Fresh(to_plain(compose(args.overrides)))  # a bad override: one line, exit 2
        run.train(args.steps)
        run.save(args.save_to / "saves" / step_dir_name(run.state.step))
        return EXIT_OK
    results, path = roundtrip(args.overrides, args.steps, not args.in_process, args.keep)
    notes = {"weight_tying_preserved": results.get("weight_tying_note")}
    notes["size_delta_pct"] = results["size_delta_note"]
    for key in SHOWN:
        note = f"  # {notes[key]}" if notes.get(key) else ""
        print(f"{key}: {jsonio.dumps_line(results[key])}{note}")
    print(f"{'PASS' if results['passed'] else 'FAIL'}: {path}")
    return EXIT_OK if results["passed"] else EXIT_ERROR


if __name__ == "__main__":
    run_command(NAME, main, INTERRUPTED)
