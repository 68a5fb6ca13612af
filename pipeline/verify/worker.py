"""One verifier process: continuous, interrupted, resume or negative (resume without the RNG streams)."""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import identity
from pipeline.files import jsonio
from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint import store
from pipeline.data.base import inference_facts
from pipeline.run.assemble import build_dataset, build_stages, build_state, data_spec
from pipeline.stages.resume import lineage_of
from pipeline.stages.base import StageStates
from pipeline.stateful import PARTS, capture, restore
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

    config = jsonio.read(Path(args.config), 1 << 24)
    dataset = build_dataset(config)
    state = build_state(config, dataset.spec, dataset.n_train, dataset)
    parts = {**state.parts(), "stages": StageStates(build_stages(config))}
    out = Path(args.out)
    restored = None
    if args.mode in ("resume", "negative"):
        only = PARTS if args.mode == "resume" else tuple(p for p in PARTS if p != "rng")
        restore(parts, store.load(Path(args.checkpoint), parts).state, only=only)  # the negative control: no rng
        restored = snapshot(state)
    target = args.cut if args.mode == "interrupted" else args.steps
    records = []
    while state.step < target:
        records.append(train_step(state))
    if args.mode == "interrupted":
        facts = mf.run_facts(config, identity.source_hashes(config), dataset.manifest_hash, data_spec(dataset),
                              inference_facts(dataset))
        fields = mf.build(facts, step=state.step, epoch=state.epoch, metrics={}, tags=[],
                          lineage=lineage_of(facts["semantic_config_hash"], None))
        store.write(out / "checkpoint", capture(parts), fields)
    write_summary(out, state, records, restored)


if __name__ == "__main__":
    main()
