"""`python -m pipeline.roundtrip [overrides]`: lab 02's checkpoint checks on the composed config.

Four checks, each on fresh objects built from the same config, written to
`<paths.output_dir>/roundtrip/<run id>/roundtrip_results.json` (exit 0 if all pass, 1 if not, 2 on a bad
override):

* byte equivalence (block D): train N steps, save, load into fresh objects, apply; every state machine
  (model, optimizer, scheduler, data_iter, rng) must equal the live one byte for byte;
* continuation (block E): 2N steps straight against N, save, and N more in a separate process that
  composes the same config and loads the checkpoint: bit-identical losses, parameters and moments;
* weight tying (block F): tied names stored once (header metadata `ALIAS(...)`), one object again after
  loading, and a weights file within 4 KiB of the unique parameters' bytes. A model without tied
  parameters reports `weight_tying_preserved: null` with a note: there is nothing to preserve, and
  "true" would claim a check that did not run;
* atomic write (block G): with os.rename/os.replace raising KeyboardInterrupt no checkpoint appears;
  a temporary left by a save killed outright is ignored by readers and removed by the next save.

`expected_size_bytes_no_tying` is the seed's figure: the bytes of the unique parameters (a tied array
counted once), without the safetensors header; `size_delta_pct` is the file's excess over it, which for
tiny models is mostly the header (`weights_header_bytes`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from pipeline.checkpoint import io
from pipeline.checkpoint.atomic import TMP_PREFIX
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.tensors import read_tensors, write_tensors
from pipeline.config import CONFIG_DIR, PROJECT_ROOT, register_all
from pipeline.model.base import state_dict as model_state

SIZE_SLACK = 4096  # bytes the weights file may exceed the unique parameters by (its header)
RESULTS = "roundtrip_results.json"


# -- config and objects -------------------------------------------------------------------------

def compose(overrides: list[str]):
    """The real conf/config.yaml with `overrides`, as `python -m pipeline` composes it (nothing written)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_all()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="roundtrip"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def build(cfg):
    from pipeline.build import build_state

    return build_state(cfg)


def facts_for(cfg, state, run_dir: Path) -> dict:
    from pipeline.build import plain
    from pipeline.facts import run_facts

    return run_facts(plain(cfg), state.dataset.manifest_hash, str(run_dir))


def train(state, n: int) -> list[float]:
    from pipeline.trainer.loop import train_step

    return [float(train_step(state)["train/loss"]) for _ in range(n)]


# -- comparisons --------------------------------------------------------------------------------

def full_state(state) -> dict[str, dict]:
    """Copies of the five state machines, in their live (not serialised) form."""
    opt = state.optimizer.state_dict()
    it = state.iterator
    return {
        "model": {k: np.array(v, copy=True) for k, v in model_state(state.model).items()},
        "optimizer": {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in opt.items()},
        "scheduler": dict(state.scheduler.state_dict()),
        "data_iter": {"epoch": it.epoch, "cursor": it.cursor, "permutation": it.permutation.copy()},
        "rng": {**{n: g.bit_generator.state for n, g in state.streams.np.items()},
                **{n: r.getstate() for n, r in state.streams.py.items()}},
    }


def difference(a, b, path: str = "") -> str | None:
    """Where two values first differ, or None if they are equal byte for byte (arrays: dtype, shape, bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if not (np.array_equal(a, b, equal_nan=True) and a.tobytes() == b.tobytes()):
            return f"{path}: values differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a.keys() ^ b.keys())} on one side only"
        for k in a:
            if d := difference(a[k], b[k], f"{path}.{k}" if path else str(k)):
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"
        for i, (x, y) in enumerate(zip(a, b)):
            if d := difference(x, y, f"{path}[{i}]"):
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{path}: {a!r} vs {b!r}"
    if type(a) is not type(b) or a != b:
        return f"{path}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"
    return None


def unique_arrays(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    seen: dict[int, np.ndarray] = {}
    for a in arrays.values():
        seen.setdefault(id(a), a)
    return list(seen.values())


def header_metadata(path: Path) -> tuple[int, dict[str, str]]:
    """(header bytes including the 8-byte length, __metadata__) read straight from the file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header.get("__metadata__", {})


# -- the four checks ----------------------------------------------------------------------------

def check_byte_equivalence(cfg, work: Path, steps: int) -> dict:
    state = build(cfg)
    train(state, steps)
    before = full_state(state)
    directory = work / "checkpoint" / io.step_dir_name(state.step)
    sha = io.save(state, directory, facts_for(cfg, state, work))
    fresh = build(cfg)
    untouched = full_state(fresh)
    io.apply(io.load(directory), fresh)
    after = full_state(fresh)
    differences = {m: d for m in io.STATE_MACHINES if (d := difference(before[m], after[m], m))}
    progress = difference({"step": state.step, "epoch": state.epoch}, {"step": fresh.step, "epoch": fresh.epoch})
    return {
        "passed": [m for m in io.STATE_MACHINES if m not in differences],
        "differences": differences,
        "progress_difference": progress,
        # a machine the fresh objects already matched proves nothing about its restore
        "unchanged_by_training": [m for m in io.STATE_MACHINES if difference(before[m], untouched[m]) is None],
        "directory": directory,
        "sha256": sha,
        "state": state,
    }


def check_continuation(cfg, overrides: list[str], work: Path, steps: int, separate_process: bool = True) -> dict:
    reference = build(cfg)
    losses_ref = train(reference, 2 * steps)
    first = build(cfg)
    losses_a = train(first, steps)
    directory = work / "continuation" / io.step_dir_name(first.step)
    io.save(first, directory, facts_for(cfg, first, work))
    if separate_process:
        out = work / "continuation" / "resumed"
        proc = continue_in_subprocess(overrides, directory, steps, out)
        if proc.returncode != 0:
            return {"passed": False, "separate_process": True,
                    "error": f"continuation process exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
        resumed, _ = read_tensors(out / "continued.safetensors")
        meta = json.loads((out / "continued.json").read_text())
        losses_b = resumed.pop("losses").tolist()
    else:
        second = build(cfg)
        io.apply(io.load(directory), second)
        losses_b = train(second, steps)
        resumed, meta = continued_arrays(second), continued_meta(second)
    expected = {**continued_arrays(reference)}
    checks = {
        "losses": difference(np.array(losses_ref), np.array(losses_a + losses_b), "losses"),
        "parameters": difference({k: v for k, v in expected.items() if k.startswith("model/")},
                                 {k: v for k, v in resumed.items() if k.startswith("model/")}),
        "moments": difference({k: v for k, v in expected.items() if k.startswith("optim/")},
                              {k: v for k, v in resumed.items() if k.startswith("optim/")}),
        "scalars": difference(continued_meta(reference), meta),
    }
    return {"passed": all(v is None for v in checks.values()), "separate_process": separate_process,
            "steps": [steps, steps], "differences": {k: v for k, v in checks.items() if v}}


def continued_arrays(state) -> dict[str, np.ndarray]:
    opt = state.optimizer.state_dict()
    return {**{f"model/{k}": v for k, v in state.model.params.items()},
            **{f"optim/{k}": v for k, v in opt.items() if isinstance(v, np.ndarray)}}


def continued_meta(state) -> dict:
    return {"step": state.step, "t": state.optimizer.t, "lr": state.optimizer.lr,
            "scheduler": state.scheduler.state_dict()}


def continue_in_subprocess(overrides: list[str], checkpoint: Path, steps: int, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "pipeline.roundtrip", "--continue-from", str(checkpoint), "--steps", str(steps),
           "--out", str(out), "--", *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def run_continuation(overrides: list[str], checkpoint: Path, steps: int, out: Path) -> None:
    """The second half of the continuation check, in its own process: results as safetensors + JSON."""
    cfg = compose(overrides)
    state = build(cfg)
    io.apply(io.load(checkpoint), state)
    losses = train(state, steps)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("continued.safetensors", "continued.json"):
        (out / name).unlink(missing_ok=True)
    write_tensors(out / "continued.safetensors", {**continued_arrays(state), "losses": np.array(losses)})
    (out / "continued.json").write_text(json.dumps(continued_meta(state)))


def check_tying(cfg, work: Path, d: dict) -> dict:
    """Tied names stored once and one object again after loading; the file's size against unique bytes."""
    state, directory = d["state"], d["directory"]
    live = model_state(state.model)
    aliases = dict(state.model.aliases)
    expected = sum(a.nbytes for a in unique_arrays(live))
    path = directory / io.WEIGHTS
    size = path.stat().st_size
    header_bytes, metadata = header_metadata(path)
    out = {"weights_file_size_bytes": size, "expected_size_bytes_no_tying": expected,
           "weights_header_bytes": header_bytes, "size_delta_pct": round(100.0 * (size - expected) / expected, 4),
           "size_within_4kib": abs(size - expected) < SIZE_SLACK, "tied": aliases}
    if not aliases:
        out["weight_tying_preserved"] = None
        out["weight_tying_note"] = "the model has no tied parameters (model.aliases is empty): nothing to preserve"
        return out
    ckpt = io.load(directory)
    fresh = build(cfg)
    io.apply(ckpt, fresh)
    fresh_live = model_state(fresh.model)
    checks = {
        "tied_before_save": all(live[a] is state.model.params[t] for a, t in aliases.items()),
        "header_alias": all(metadata.get(a) == f"ALIAS({t})" for a, t in aliases.items()),
        "stored_once": all(a not in _tensor_names(path) for a in aliases),
        "one_object_after_load": all(ckpt.weights[a] is ckpt.weights[t] for a, t in aliases.items()),
        "one_object_after_apply": all(fresh_live[a] is fresh.model.params[t] for a, t in aliases.items()),
        "size_within_4kib": out["size_within_4kib"],
    }
    out["weight_tying_checks"] = checks
    out["weight_tying_preserved"] = all(checks.values())
    return out


def _tensor_names(path: Path) -> set[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return set(json.loads(f.read(n))) - {"__metadata__"}


def check_atomic(cfg, work: Path) -> dict:
    """An interrupted rename leaves nothing visible; a killed save's temporary is ignored, then cleaned up."""
    from pipeline.stages.context import list_checkpoints

    state = build(cfg)
    train(state, 2)
    facts = facts_for(cfg, state, work)
    parent = work / "atomic"
    directory = parent / io.step_dir_name(state.step)
    interrupted = False
    with mock.patch("os.rename", side_effect=KeyboardInterrupt), mock.patch("os.replace", side_effect=KeyboardInterrupt):
        try:
            io.save(state, directory, facts)
        except KeyboardInterrupt:
            interrupted = True
    no_final = not directory.exists()
    # A save killed outright (SIGKILL) runs no cleanup: leave the half-written temporary it would leave.
    stale = parent / f"{TMP_PREFIX}{directory.name}-killed00"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / io.WEIGHTS).write_bytes(b"\0" * 100)
    ignored = list_checkpoints(parent) == []
    io.save(state, directory, facts)
    leftovers = sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP_PREFIX))
    try:
        io.verify(directory)
        verifies = True
    except CheckpointError:
        verifies = False
    checks = {"interrupted": interrupted, "no_final_directory": no_final, "readers_ignore_temporary": ignored,
              "next_save_cleans_up": not leftovers, "next_save_verifies": verifies}
    return {"passed": all(checks.values()), "checks": checks, "leftovers": leftovers}


# -- the command --------------------------------------------------------------------------------

def roundtrip(overrides: list[str], steps: int = 10, separate_process: bool = True, keep: bool = False) -> tuple[dict, Path]:
    from pipeline.build import plain
    from pipeline.identity import run_id

    cfg = compose(overrides)
    config = plain(cfg)
    out = Path(config["paths"]["output_dir"]) / "roundtrip" / run_id(config)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("checkpoint", "manifest.json", RESULTS):
        p = out / old
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=out))
    try:
        d = check_byte_equivalence(cfg, out, steps)
        manifest = json.loads((d["directory"] / io.MANIFEST).read_text())
        shutil.copyfile(d["directory"] / io.MANIFEST, out / "manifest.json")
        tying = check_tying(cfg, scratch, d)
        continuation = check_continuation(cfg, overrides, scratch, steps, separate_process)
        atomic = check_atomic(cfg, scratch)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    results = {
        "byte_equivalent_state_machines": d["passed"],
        "all_byte_equal": len(d["passed"]) == len(io.STATE_MACHINES) and d["progress_difference"] is None,
        "continuation_test_passed": continuation["passed"],
        "weight_tying_preserved": tying["weight_tying_preserved"],
        "atomic_write_resilient": atomic["passed"],
        "weights_file_size_bytes": tying["weights_file_size_bytes"],
        "expected_size_bytes_no_tying": tying["expected_size_bytes_no_tying"],
        "size_delta_pct": tying["size_delta_pct"],
        "manifest_schema_version": manifest.get("schema_version"),
        "weights_header_bytes": tying["weights_header_bytes"],
        "size_within_4kib": tying["size_within_4kib"],
        "tied": tying["tied"],
        "state_differences": d["differences"],
        "unchanged_by_training": d["unchanged_by_training"],
        "continuation": continuation,
        "atomic": atomic,
        "checkpoint": str(d["directory"]),
        "checkpoint_sha256": d["sha256"],
        "steps": steps,
        "overrides": list(overrides),
    }
    for key in ("weight_tying_note", "weight_tying_checks"):
        if key in tying:
            results[key] = tying[key]
    results["passed"] = bool(results["all_byte_equal"] and results["continuation_test_passed"]
                             and results["weight_tying_preserved"] is not False and results["atomic_write_resilient"]
                             and results["size_within_4kib"] and results["manifest_schema_version"] == io.SCHEMA_VERSION)
    path = out / RESULTS
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    return results, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.roundtrip", description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m pipeline")
    ap.add_argument("--steps", type=int, default=10, help="steps before the checkpoint, and after it (default 10)")
    ap.add_argument("--in-process", action="store_true", help="continue in this process instead of a fresh one")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories of the checks")
    ap.add_argument("--continue-from", type=Path, help=argparse.SUPPRESS)  # the continuation's child process
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_intermixed_args(argv)  # options may come between the overrides
    if args.continue_from is not None:
        run_continuation(args.overrides, args.continue_from, args.steps, args.out)
        return 0
    try:
        compose(args.overrides)
    except Exception as e:  # hydra's override and config errors: one line, exit 2
        print(f"roundtrip: bad config or override: {e}", file=sys.stderr)
        return 2
    results, path = roundtrip(args.overrides, args.steps, not args.in_process, args.keep)
    for key in ("byte_equivalent_state_machines", "all_byte_equal", "continuation_test_passed",
                "weight_tying_preserved", "atomic_write_resilient", "weights_file_size_bytes",
                "expected_size_bytes_no_tying", "size_delta_pct", "manifest_schema_version"):
        print(f"{key}: {json.dumps(results[key])}")
    print(f"{'PASS' if results['passed'] else 'FAIL'}: {path}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
