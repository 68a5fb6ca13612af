"""One verifier process: continuous, interrupted, resume or negative (resume without the RNG streams)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.build import build_state
from pipeline.checkpoint import io
from pipeline.facts import run_facts
from pipeline.trainer.loop import train_step
from pipeline.verify.snapshot import snapshot, write_summary

MODES = ("continuous", "interrupted", "resume", "negative")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="resolved config as JSON")
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--cut", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="the interrupted run's checkpoint (resume, negative)")
    args = ap.parse_args(argv)

    from pipeline.config import register_all

    register_all()
    config = json.loads(Path(args.config).read_text())
    state = build_state(OmegaConf.create(config))
    out = Path(args.out)
    restored = None
    if args.mode in ("resume", "negative"):
        restore = io.STATE_MACHINES if args.mode == "resume" else tuple(m for m in io.STATE_MACHINES if m != "rng")
        io.apply(io.load(Path(args.checkpoint)), state, restore=restore)
        restored = snapshot(state)
    target = args.cut if args.mode == "interrupted" else args.steps
    records = []
    while state.step < target:
        records.append(train_step(state))
    if args.mode == "interrupted":
        io.save(state, out / "checkpoint", run_facts(config, state.dataset.manifest_hash, str(out)))
    write_summary(out, state, records, restored)


if __name__ == "__main__":
    main()
