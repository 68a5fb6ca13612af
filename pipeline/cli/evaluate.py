"""`python -m pipeline.evaluate CHECKPOINT [overrides] [--json]`: the validation metrics of any checkpoint.

On its own data, what its run measured at that step; other data (`data=NAME`, `data.KEY=V`) must fit its spec."""

from __future__ import annotations

from pathlib import Path

from pipeline.cli import emit, metrics_line, parser
from pipeline.config.errors import EXIT_OK
from pipeline.run.signals import command, run_command

NAME = "pipeline.evaluate"
EPILOG = "Overrides: data=NAME, data.KEY=VALUE, paths.output_dir=DIR (where the corpus cache is; "
EPILOG += "default the run's), hydra.searchpath=[...]"


def evaluate_checkpoint(directory: Path, overrides: tuple[str, ...] | list[str] = ()) -> dict:
    """Its metrics on its own or other data; one-line ConfigError/CheckpointError for what does not verify or fit."""
    from pipeline.run.trained import checkpoint_data, restore_checkpoint
    from pipeline.trainer.loop import validate

    manifest, state = restore_checkpoint(directory, list(overrides))
    state.dataset = dataset = checkpoint_data(manifest, list(overrides), directory)
    out = dict(checkpoint=str(directory), step=manifest["step"], data=type(dataset).__name__)
    h, own = dataset.manifest_hash, dataset.manifest_hash == manifest["data_manifest_hash"]
    return out | dict(data_manifest_hash=h, own_data=own, metrics=validate(state))


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    ap = parser(NAME, __doc__, epilog=EPILOG)
    ap.add_argument("checkpoint", type=Path, help="a checkpoint directory (step-*, best, final)")
    ap.add_argument("overrides", nargs="*", help="data overrides")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    result = evaluate_checkpoint(args.checkpoint, args.overrides)
    emit(result, args.json, lambda r: f"step={r['step']} {metrics_line(r['metrics'])}")
    return EXIT_OK


if __name__ == "__main__":
    run_command(NAME, main)
