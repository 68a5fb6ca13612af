"""One verifier process (continuous, interrupted, resume, negative), and Fresh, the run it and roundtrip step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint, CheckpointDir
from pipeline.config import identity, targets
from pipeline.config.errors import EXIT_BAD_INPUT, ConfigError
from pipeline.config.identity import lineage_of
from pipeline.files import jsonio
from pipeline.files.limits import MAX_WORKER_CONFIG
from pipeline.run.assemble import assemble
from pipeline.stateful import PARTS, capture, copy_tree, restore
from pipeline.trainer.loop import train_step
from pipeline.verify.snapshot import snapshot, write_summary

MODES = ("continuous", "interrupted", "resume", "negative")


class Fresh:
    """One run of `config` (pipeline.run.assemble) stepped in this process, without a run directory."""

    def __init__(self, config: dict):
        self.job = assemble(config, identity.identify(config))
        self.state, self.parts = self.job.state, self.job.parts

    def train(self, n: int) -> list[dict]:
        return [train_step(self.state) for _ in range(n)]

    def fields(self) -> dict:
        """The manifest fields of the current step, those of a run history of its own."""
        facts = self.job.facts
        return mf.build(
            facts,
            step=self.state.step,
            epoch=self.state.epoch,
            metrics={},
            tags=[],
            lineage=lineage_of(facts["semantic_config_hash"], None),
        )

    def save(self, directory: Path) -> dict:
        return CheckpointDir(directory).write(capture(self.parts), self.fields())

    def load(self, directory: Path, only: tuple[str, ...] = PARTS) -> Checkpoint:
        ckpt = CheckpointDir(directory).load(self.parts)
        restore(self.parts, ckpt.state, only=only)
        return ckpt

    def snapshot(self) -> dict:
        return copy_tree(capture(self.parts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="One verifier process.")
    ap.add_argument("--config", required=True, help="resolved config as JSON")
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--cut", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="the interrupted run's checkpoint (resume, negative)")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        help="an override the config was composed from: what its `_target_`s may name",
    )
    args = ap.parse_args(argv)

    config = jsonio.read(Path(args.config), MAX_WORKER_CONFIG)
    try:  # a file decides no code: only conf/ and this command line's overrides name what it may build
        targets.check(config, targets.allowed(tuple(args.override)))
    except ConfigError as e:
        print(f"pipeline.verify.worker: {args.config}: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    run = Fresh(config)
    out = Path(args.out)
    restored = None
    if args.mode in ("resume", "negative"):
        run.load(
            Path(args.checkpoint),
            PARTS if args.mode == "resume" else tuple(p for p in PARTS if p != "rng"),
        )
        restored = snapshot(run.state)
    records = run.train((args.cut if args.mode == "interrupted" else args.steps) - run.state.step)
    if args.mode == "interrupted":
        run.save(out / "checkpoint")
    write_summary(out, run.state, records, restored)


if __name__ == "__main__":
    main()
