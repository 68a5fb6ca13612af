"""What stages share during one run: the live state, the run directory, and the one checkpoint saver."""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from pipeline import chaos
from pipeline.checkpoint import io
import json
import time

from pipeline.checkpoint.atomic import replace_link, write_json
from pipeline.checkpoint.errors import CheckpointError

log = logging.getLogger("pipeline")
STEP_DIR = re.compile(r"^step-(\d{8})$")


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every visible step directory, oldest first; temporaries are ignored."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def link_target_step(link: Path) -> int | None:
    if not link.is_symlink():
        return None
    m = STEP_DIR.match(os.readlink(link))
    return int(m.group(1)) if m else None


class RunContext:
    def __init__(self, state, run_dir: Path, facts: dict, stages: list):
        self.state, self.run_dir, self.facts, self.stages = state, Path(run_dir), facts, stages
        self.ckpt_root = self.run_dir / "checkpoints"
        self.resumed_from: int | None = None  # protected until a newer checkpoint verifies
        self.complete = False  # set by the resume stage when the run already finished
        self.extra_sinks: list = []  # callables(checkpoint dir, manifest) run after each save (tracking)
        self.before_save: list = []  # callables run before each save (e.g. learning the tracked run's URI)
        self.resumed_manifest: dict | None = None

    def read_status(self) -> dict:
        try:
            return json.loads((self.run_dir / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def write_status(self, status: str) -> None:
        """run.json: what a person (or a re-run) needs to know at a glance; replaced atomically."""
        tmp = self.run_dir / ".run.json.tmp"
        write_json(tmp, {"status": status, "step": self.state.step, "total_steps": self.state.total_steps,
                         "epoch": self.state.epoch, "metrics": self.state.metrics, "updated": time.time(),
                         "config_hash": self.facts.get("config_hash"),
                         "data_manifest_hash": self.facts.get("data_manifest_hash")})
        os.replace(tmp, self.run_dir / "run.json")

    def stage_states(self) -> dict:
        return {s.name: s.state_dict() for s in self.stages}

    def load_stage_states(self, states: dict) -> None:
        for s in self.stages:
            if s.name in states:
                s.load_state_dict(states[s.name])

    def save(self) -> Path:
        """Checkpoint the current step once (stages asking for the same step share it), then verify it."""
        step = self.state.step
        directory = self.ckpt_root / io.step_dir_name(step)
        for hook in self.before_save:
            hook()
        io.save(self.state, directory, self.facts, self.stage_states())
        manifest = io.verify(directory)  # re-read and re-hash: only a verified checkpoint counts
        if self.resumed_from is not None and step > self.resumed_from:
            self.resumed_from = None
        for sink in self.extra_sinks:
            sink(directory, manifest)
        return directory

    def checkpoint(self, links: tuple[str, ...] = ()) -> Path:
        """Save and verify this step, point `links` at it, then let every stage react (rotate, best)."""
        directory = self.save()
        for name in links:
            self.point(name, self.state.step)
        for s in self.stages:
            s.on_checkpoint(self, self.state.step, directory)
        return directory

    def point(self, link_name: str, step: int) -> None:
        chaos.point("save", f"before {link_name} link")
        replace_link(self.ckpt_root / link_name, io.step_dir_name(step))

    def protected_steps(self) -> set[int]:
        steps = {s for name in ("best", "final") if (s := link_target_step(self.ckpt_root / name)) is not None}
        if self.resumed_from is not None:
            steps.add(self.resumed_from)
        return steps

    def is_periodic(self, step: int) -> bool:
        return any(step in getattr(s, "periodic", ()) for s in self.stages)

    def delete(self, step: int) -> None:
        directory = self.ckpt_root / io.step_dir_name(step)
        # Rename first so a crash mid-delete never leaves a half-deleted directory that looks like a checkpoint.
        doomed = self.ckpt_root / f".tmp-deleting-{directory.name}"
        if directory.exists():
            chaos.point("save", "before delete")
            os.rename(directory, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def newest_valid(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that verifies, and a line for each newer one skipped and why."""
        skipped = []
        for step, directory in reversed(list_checkpoints(self.ckpt_root)):
            try:
                io.verify(directory)
                return directory, skipped
            except CheckpointError as e:
                skipped.append(str(e))
        return None, skipped
