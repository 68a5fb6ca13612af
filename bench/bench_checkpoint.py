"""Checkpoint save/load throughput and save's extra memory against raw file I/O of the same bytes.

    python bench/bench_checkpoint.py [--mib 256] [--repeats 3] [--dir DIR]

A ~256 MiB state (four float32 weight matrices plus Adam's two moments each, and the other parts of a
run's state) is saved with pipeline.checkpoint.directory.CheckpointDir.write (hashing, fsync of every file, rename,
fsync of the parent included) and compared with a raw write + fsync of the same bytes; load + full verification
against the expected layout (pipeline.checkpoint.directory.CheckpointDir.load) is compared with a raw read + sha256
of the same bytes. Measurements
alternate and the medians are compared, so each ratio comes from one run on one (noisy, shared) machine.
Reads are warm (page cache) on both sides: dropping caches would disturb the other users of the machine.
Extra peak memory during save is measured in a child process: peak RSS (VmHWM, reset through
/proc/self/clear_refs) minus the RSS once the state is built.

The bench files go to a temporary directory on the disk that holds this checkout (not tmpfs) and are
removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.checkpoint import manifest as mf  # noqa: E402
from pipeline.checkpoint.directory import CheckpointDir  # noqa: E402
from pipeline.config import identity  # noqa: E402
from pipeline.config.identity import Identity, lineage_of  # noqa: E402
from pipeline.data.iterator import DataIterator  # noqa: E402
from pipeline.model.base import NamedParams  # noqa: E402
from pipeline.optimizer.adam import Adam  # noqa: E402
from pipeline.scheduler.constant import Constant  # noqa: E402
from pipeline.stages.base import StageStates  # noqa: E402
from pipeline.stateful import capture  # noqa: E402
from pipeline.trainer.rng import Streams  # noqa: E402
from pipeline.trainer.state import Progress  # noqa: E402

TARGETS = {"save": 0.65, "load": 1.5, "memory": 0.10}
MIB = 2**20


class Weights(NamedParams):
    def __init__(self, params):
        self.params = params


def build_parts(mib: float, seed: int = 0) -> dict:
    """A run's parts whose params + Adam moments total about `mib` MiB of float32 (4 matrices, 3 arrays each)."""
    per_array = int(mib * MIB / 12)  # 4 params x (param, exp_avg, exp_avg_sq)
    cols = 1024
    rows = max(1, per_array // (4 * cols))
    g = np.random.default_rng(seed)
    params = {
        f"layers.{i}.weight": g.standard_normal((rows, cols), dtype=np.float32) for i in range(4)
    }
    optimizer = Adam(
        params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, weight_decay_on="all"
    )
    for kind in optimizer.buffers:  # materialise the moments with non-trivial values
        for v in optimizer.state_dict()[kind].values():
            v[...] = g.standard_normal(v.shape, dtype=np.float32)
    optimizer.t = 7
    streams = Streams(seed)
    return {
        "model": Weights(params),
        "optimizer": optimizer,
        "scheduler": Constant(optimizer),
        "data_iter": DataIterator(1000, 10, streams["data_order"]),
        "rng": streams,
        "progress": Progress(step=7),
        "stages": StageStates([]),
    }


def state_arrays(parts: dict) -> list[np.ndarray]:
    return [*parts["model"].params.values(), *parts["optimizer"].state.values()]


def bench_fields() -> dict:
    config = {"bench": "checkpoint", "trainer": {"seed": 0}}
    semantic = identity.semantic_hash(config, {})
    ident = Identity(
        {}, identity.config_hash(config), semantic, "bench", lineage_of(semantic, None)
    )
    facts = mf.run_facts(
        config, ident, "none", {}, {"vocab": None, "decode_join": None, "specials": {}}
    )
    return mf.build(facts, step=7, epoch=0, metrics={}, tags=[], lineage=ident.lineage)


def save(parts: dict, directory: Path) -> None:
    CheckpointDir(directory).write(capture(parts), bench_fields())


def raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        os.fsync(f.fileno())


def raw_read_sha(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(mib: float, directory: str) -> None:
    """In a fresh process: build the state, reset the peak, save, and print the extra peak RSS as JSON."""
    parts = build_parts(mib)
    state_bytes = sum(a.nbytes for a in state_arrays(parts))
    base = rss_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text(
            "5"
        )  # resets VmHWM to the current RSS (Linux >= 4.0)
        method = "VmHWM after clear_refs"
    except OSError:
        method = "VmHWM since start (clear_refs unavailable)"
    save(parts, Path(directory) / "step-00000007")
    peak = rss_kib("VmHWM")
    print(
        json.dumps(
            {
                "state_bytes": state_bytes,
                "base_kib": base,
                "peak_kib": peak,
                "extra_bytes": max(0, peak - base) * 1024,
                "method": method,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0, help="state size in MiB (params + moments)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--dir",
        default=None,
        help="scratch parent directory (default: a temp dir beside the checkout)",
    )
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(args.mib, args.memory_child)
        return 0

    scratch = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=args.dir or ROOT.parent))
    try:
        parts = build_parts(args.mib)
        arrays = state_arrays(parts)
        nbytes = sum(a.nbytes for a in arrays)
        raw_file = scratch / "raw.bin"
        times = {"raw_write": [], "save": [], "raw_read": [], "load": []}
        for r in range(-1, args.repeats):  # r = -1: a warm-up round, not counted
            ckpt = scratch / f"ckpt-{r + 1}" / "step-00000007"  # the step its manifest says
            # os.sync() before each timed step: this disk is mounted with `discard`, and the first fsync
            # after a deletion pays for it; neither side should pay for the other's (or its own) cleanup.
            os.sync()
            times["raw_write"].append(timed(lambda: raw_write(raw_file, arrays)))
            os.sync()
            times["save"].append(timed(lambda ckpt=ckpt: save(parts, ckpt)))
            os.sync()
            times["raw_read"].append(timed(lambda: raw_read_sha(raw_file)))
            times["load"].append(timed(lambda ckpt=ckpt: CheckpointDir(ckpt).load(parts)))
            raw_file.unlink()
            shutil.rmtree(ckpt)
            if r < 0:
                times = {k: [] for k in times}
        med = {k: statistics.median(v) for k, v in times.items()}
        child = subprocess.run(
            [sys.executable, __file__, "--mib", str(args.mib), "--memory-child", str(scratch)],
            capture_output=True,
            text=True,
            check=True,
        )
        mem = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    save_ratio = med["raw_write"] / med["save"]  # throughput of save relative to raw write+fsync
    load_ratio = med["load"] / med["raw_read"]  # time of load+verify relative to raw read+sha256
    mem_ratio = mem["extra_bytes"] / mem["state_bytes"]
    mib_s = lambda t: nbytes / MIB / t  # noqa: E731
    print(f"command: python bench/bench_checkpoint.py --mib {args.mib:g} --repeats {args.repeats}")
    print(
        f"state: {nbytes / MIB:.1f} MiB ({len(arrays)} float32 arrays: params + Adam moments); "
        f"medians of {args.repeats}; scratch on {scratch.parent}"
    )
    print()
    print("| measure | time (s) | MiB/s | ratio | target | ok |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    print(f"| raw write + fsync | {med['raw_write']:.3f} | {mib_s(med['raw_write']):.0f} | | | |")
    print(
        f"| CheckpointDir.write (hash, fsync, rename) | {med['save']:.3f} | {mib_s(med['save']):.0f} | "
        f"{save_ratio:.2f}x raw throughput | >= {TARGETS['save']:.2f} | {save_ratio >= TARGETS['save']} |"
    )
    print(
        f"| raw read + sha256 (warm) | {med['raw_read']:.3f} | {mib_s(med['raw_read']):.0f} | | | |"
    )
    print(
        f"| CheckpointDir.load + verify (warm) | {med['load']:.3f} | {mib_s(med['load']):.0f} | "
        f"{load_ratio:.2f}x raw time | <= {TARGETS['load']:.2f} | {load_ratio <= TARGETS['load']} |"
    )
    print(
        f"| extra peak RSS during save | | {mem['extra_bytes'] / MIB:.1f} MiB | "
        f"{100 * mem_ratio:.1f}% of state | <= {100 * TARGETS['memory']:.0f}% | {mem_ratio <= TARGETS['memory']} |"
    )
    best_save, best_load = (
        min(times["raw_write"]) / min(times["save"]),
        min(times["load"]) / min(times["raw_read"]),
    )
    print()
    print(
        f"best-of-{args.repeats} ratios (less sensitive to other load on the machine): "
        f"save {best_save:.2f}x raw throughput, load {best_load:.2f}x raw time"
    )
    print("all times (s): " + json.dumps({k: [round(t, 3) for t in v] for k, v in times.items()}))
    print(
        f"memory: {mem['method']}; base RSS {mem['base_kib'] / 1024:.0f} MiB, peak {mem['peak_kib'] / 1024:.0f} MiB"
    )
    ok = (
        save_ratio >= TARGETS["save"]
        and load_ratio <= TARGETS["load"]
        and mem_ratio <= TARGETS["memory"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
