"""A cost that grows with the model, not the data (issue 41): a generated UTF-8 text of --size bytes (1 GiB by
default, written under --dir, never shipped) prepared into its corpus, with the preparing process's peak RSS and
throughput; then the same 2-update job on it and on a 1 MiB text, whose checkpoints must be the same size.

    python bench/bench_data.py                  # 1 GiB: peak RSS <= 1 GiB, >= 20 MB/s
    python bench/bench_data.py --size 67108864  # 64 MiB, a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Prose-like words, a few with characters outside ASCII (every piece then takes the decoder's slow path).
SYLLABLES = [
    "th",
    "e",
    "an",
    "or",
    "qu",
    "é",
    "ing",
    "st",
    "ou",
    "ü",
    "a",
    "is",
    "—",
    "ly",
    "ch",
    "er",
]


def generate(path: Path, size: int, seed: int = 0) -> None:
    """`size` bytes of UTF-8: Zipf-distributed made-up words in sentences and lines, written in pieces."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, rng.integers(1, 5))).encode() for _ in range(5000)] + [
        b".\n",
        b",",
        b"!\n",
    ]
    written = 0
    with open(path, "wb") as f:
        while written < size:
            idx = rng.zipf(1.2, 2_000_000) % len(words)
            piece = b" ".join(words[i] for i in idx)[: size - written]
            piece = piece.decode(
                errors="ignore"
            ).encode()  # a cut character at the very end dropped
            f.write(piece)
            written += len(piece)


MEASURE = """
import os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[2:]], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{usage.ru_maxrss} {time.perf_counter() - t0}")
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def measured(args: list[str], scratch: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `python *args` in a process of its own."""
    report = scratch / "maxrss.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", MEASURE, str(report), *args], env=env, check=True)
    rss, seconds = report.read_text().split()
    return int(rss) / 1024, float(seconds)


PREPARE = (
    "import sys; from pipeline.data.text import TextCorpus; "
    "d = TextCorpus(sys.argv[1], sys.argv[2], val_fraction=0.1, block_size=64, ngram_order=5, "
    "val_batch_size=32, max_bytes=1 << 31, every_offset=False); "
    "print(d.n_train, d.n_val, d.manifest['baseline'])"
)
JOB = (
    "experiment=nanogpt_char_cpu",
    "trainer.max_steps=2",
    "trainer.eval_batches=2",
    "trainer.eval_at_start=false",
    "data.max_bytes=2147483648",
    "tracking=none",
    "trainer.progress_bar=false",
)


def zeroed(v):
    """A JSON value with every number (and every decimal string: an RNG's 128-bit state) written as 0."""
    if isinstance(v, dict):
        return {k: zeroed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [zeroed(x) for x in v]
    numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
    return 0 if numeric or (isinstance(v, str) and v.isdigit()) else v


def checkpoint_sizes(out: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Each file of the run's last checkpoint: (its size, its size with every JSON number written as 0)."""
    (run,) = (out / "runs").iterdir()
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    raw = {p.name: p.stat().st_size for p in last.iterdir()}
    numbers = {
        p.name: len(json.dumps(zeroed(json.loads(p.read_bytes()))))
        for p in last.iterdir()
        if p.suffix == ".json"
    }
    return raw, {**raw, **numbers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes of generated text (1 GiB)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_data"), help="scratch (removed)")
    ap.add_argument("--keep", action="store_true", help="keep the texts in --dir (and reuse them)")
    args = ap.parse_args()
    scratch = args.dir
    texts = {"large": scratch / "large" / "t.txt", "small": scratch / "small" / "t.txt"}
    for text in texts.values():
        shutil.rmtree(text.parent / "out", ignore_errors=True)
    try:
        for name, size in (("large", args.size), ("small", 1 << 20)):
            texts[name].parent.mkdir(parents=True, exist_ok=True)
            if texts[name].exists() and abs(texts[name].stat().st_size - size) < 4:
                continue
            t0 = time.perf_counter()
            generate(texts[name], size)
            print(f"generated {name}: {size} bytes in {time.perf_counter() - t0:.1f} s", flush=True)
        out = {name: texts[name].parent / "out" for name in texts}
        rss, seconds = measured(
            ["-c", PREPARE, str(out["large"] / "data"), str(texts["large"])], scratch
        )
        mb = args.size / 1e6
        print(
            f"prepared {args.size} bytes ({mb:.0f} MB): peak RSS {rss:.0f} MiB, {seconds:.1f} s, "
            f"{mb / seconds:.1f} MB/s (acceptance: <= 1024 MiB, >= 20 MB/s)",
            flush=True,
        )
        sizes = {}
        for name in texts:
            job = [
                "-m",
                "pipeline",
                *JOB,
                f"data.path={texts[name]}",
                f"paths.output_dir={out[name]}",
            ]
            rss, seconds = measured(job, scratch)
            sizes[name] = checkpoint_sizes(out[name])
            print(
                f"job on {name}: peak RSS {rss:.0f} MiB, {seconds:.1f} s; checkpoint {sizes[name][0]}"
            )
        same = sizes["large"][1] == sizes["small"][1]
        print(
            f"checkpoint sizes equal (the JSON's numbers' digits aside): {same}; "
            f"raw totals {sum(sizes['large'][0].values())} / {sum(sizes['small'][0].values())} bytes"
        )
        return 0 if same else 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
