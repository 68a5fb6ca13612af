"""The resume stage: continue from the newest checkpoint that verifies, or a given one, refusing drift."""
from __future__ import annotations

import logging
from pathlib import Path

from pipeline.checkpoint import io
from pipeline.identity import changed_keys, semantic_config
from pipeline.stages.base import Stage
from pipeline.trainer.metrics_log import truncate_metrics

log = logging.getLogger("pipeline")


class DriftError(Exception):
    """The checkpoint was made by a different config or data than the current run's."""


def allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


def drift(manifest: dict, config: dict, data_hash: str) -> dict[str, tuple]:
    changes = changed_keys(semantic_config(manifest.get("config", {})), semantic_config(config))
    if manifest.get("data_manifest_hash") != data_hash:
        changes["data_manifest_hash"] = (manifest.get("data_manifest_hash"), data_hash)
    return changes


class Resume(Stage):
    name = "resume"

    def __init__(self, source: str = "auto", allow_changes: list[str] | None = None, order: int = 0):
        super().__init__(order)
        self.source, self.allow_changes = str(source), list(allow_changes or [])

    def setup(self, ctx) -> None:
        if self.source == "never":
            return
        if self.source == "auto":
            directory, skipped = ctx.newest_valid()
            for reason in skipped:
                log.warning("not resuming from a damaged checkpoint, falling back: %s", reason)
            if directory is None:
                # Nothing to resume: lines a killed earlier attempt logged before its first checkpoint go.
                truncate_metrics(ctx.run_dir / "metrics.jsonl", 0)
                return
        else:
            directory = Path(self.source).expanduser().resolve()
        ckpt = io.load(directory)
        changes = drift(ckpt.manifest, ctx.facts["config"], ctx.facts["data_manifest_hash"])
        refused = {k: v for k, v in changes.items() if not allowed(k, self.allow_changes)}
        if refused:
            listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
            raise DriftError(f"refusing to resume from {directory}: the config or data changed ({listing}); "
                             f"allow with resume.allow_changes=[{','.join(refused)}] or start over with resume=never")
        if changes:
            ctx.facts["allowed_changes"] = {k: [old, new] for k, (old, new) in changes.items()}
            log.warning("resuming with allowed changes: %s", ", ".join(changes))
        if ctx.read_status().get("status") == "complete" and ckpt.step >= ctx.state.total_steps \
                and directory.parent == ctx.ckpt_root:
            ctx.complete = True
            ctx.state.metrics = dict(ckpt.manifest.get("metrics", {}))
            ctx.state.step = ckpt.step
            return
        io.apply(ckpt, ctx.state)
        ctx.load_stage_states(ckpt.extra.get("callbacks", {}))
        if directory.parent == ctx.ckpt_root:
            ctx.resumed_from = ckpt.step
        truncate_metrics(ctx.run_dir / "metrics.jsonl", ckpt.step)
        ctx.facts["resumed_from"] = str(directory)
        ctx.resumed_manifest = ckpt.manifest
        log.info("resumed from %s at step %d (epoch %d)", directory, ckpt.step, ckpt.manifest.get("epoch", 0))
