"""One verifier process (continuous, interrupted, resume, negative), and Fresh, the run it and roundtrip step."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import Checkpoint, CheckpointDir
from pipeline.config import identity, targets
from pipeline.config.errors import EXIT_OK, ConfigError
from pipeline.config.identity import lineage_of
from pipeline.files import jsonio
from pipeline.files.limits import MAX_WORKER_CONFIG
from pipeline.run.assemble import assemble
from pipeline.run.signals import run_command
from pipeline.stateful import PARTS, capture, copy_tree, restore
from pipeline.trainer.loop import train_step
from pipeline.verify.protocol import MODES
from pipeline.verify.snapshot import snapshot, write_summary

NAME = "pipeline.verify.worker"


class Fresh:
    """One run of `config` (pipeline.run.assemble) stepped in this process, without a run directory."""

    def __init__(self, config: dict):
        self.job = assemble(config, identity.identify(config))
        self.state, self.parts = self.job.state, self.job.parts

    def train(self, n: int) -> list[dict]:
        return [train_step(self.state) for _ in range(n)]

    def fields(self) -> dict:
        """The manifest fields of the current step, those of a run history of its own."""
        facts, s = self.job.facts, self.state
        lineage = lineage_of(facts["semantic_config_hash"], None)
        return mf.build(facts, step=s.step, epoch=s.epoch, metrics={}, tags=[], lineage=lineage)

    def save(self, directory: Path) -> dict:
        return CheckpointDir(directory).write(capture(self.parts), self.fields())

    def load(self, directory: Path, only: tuple[str, ...] = PARTS) -> Checkpoint:
        ckpt = CheckpointDir(directory).load(self.parts)
        restore(self.parts, ckpt.state, only=only)
        return ckpt

    def snapshot(self) -> dict:
        return copy_tree(capture(self.parts))


def work(config: dict, mode: str, cut: int, steps: int, out: Path, checkpoint: Path) -> None:
    """One worker's run to `cut` (interrupted: saved) or `steps` (resume; negative: all but the RNG), summarised."""
    run, restored = Fresh(config), None
    if mode in ("resume", "negative"):
        run.load(checkpoint, PARTS if mode == "resume" else tuple(p for p in PARTS if p != "rng"))
        restored = snapshot(run.state)
    records = run.train((cut if mode == "interrupted" else steps) - run.state.step)
    if mode == "interrupted":
        run.save(checkpoint)
    write_summary(out, run.state, records, restored)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One verifier process.")
    add = ap.add_argument
    add("--config", required=True, help="resolved config as JSON")
    add("--mode", choices=MODES, required=True)
    for n in ("--cut", "--steps"):
        add(n, type=int, required=True)
    add("--out", required=True)
    add("--checkpoint", help="the interrupted run's checkpoint (default: OUT/checkpoint)")
    add("--override", action="append", default=[], help="what a `_target_` may name")
    args = ap.parse_args(argv)
    config = jsonio.read(Path(args.config), MAX_WORKER_CONFIG)
    try:  # a file decides no code: only conf/ and this command line's overrides name what it may build
        targets.check(config, targets.allowed(tuple(args.override)))
    except ConfigError as e:
        raise ConfigError(f"{args.config}: {e}") from None
    out = Path(args.out)
    work(config, args.mode, args.cut, args.steps, out, Path(args.checkpoint or out / "checkpoint"))
    return EXIT_OK


if __name__ == "__main__":
    run_command(NAME, main)
