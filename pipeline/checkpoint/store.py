"""A run's store of checkpoints (layout: docs/checkpoints.md): its step directories and links, saving, retention."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from errno import EEXIST, ELOOP
from pathlib import Path

from pipeline.checkpoint import directory as cd
from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.errors import CheckpointError, MisfitError
from pipeline.checkpoint.retention import AnyOf, Policy, Record, select_one
from pipeline.files import atomic, jsonio, killpoint
from pipeline.files.atomic import TMP_PREFIX, UnsafePathError

Skipped = list[tuple[Path, str, str]]  # (step directory, what it is, why it was passed over)


def _record(m: dict) -> Record:
    metrics = {k: jsonio.number(v) for k, v in m["metrics"].items()}
    return Record(int(m["step"]), metrics, frozenset(m["tags"]), m["lineage"]["id"])


class CheckpointStore:
    """A run's store: its step directories, the links stages declare, and retention after every save."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._records: dict[int, Record] | None = None

    def scan(self) -> tuple[list[tuple[int, Path]], dict[str, str]]:
        """(step, directory) of every step directory, oldest first, and {link: target}; a stray an UnsafePathError."""
        if not os.path.lexists(self.root):
            return [], {}
        if not stat.S_ISDIR(os.lstat(self.root).st_mode):
            why = "is not a directory (a symlink or a file); remove it"
            raise UnsafePathError(ELOOP, f"{self.root} {why}")
        steps, links = [], {}
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.startswith(TMP_PREFIX):
                    continue
                if e.is_symlink():
                    target = os.readlink(e.path)
                    if problem := cd.link_problem(e.name, target):
                        why = f"{e.path} is a symlink to {cd._shown(target)}: {problem}; remove it"
                        raise UnsafePathError(ELOOP, why)
                    links[e.name] = target
                elif (m := cd.STEP_DIR.match(e.name)) and e.is_dir(follow_symlinks=False):
                    steps.append((int(m.group(1)), Path(e.path)))
                else:
                    why = f"{e.path} is not a checkpoint step directory; {cd.STORE}/ holds step"
                    raise UnsafePathError(EEXIST, why + " directories and links only: remove it")
        return sorted(steps), links

    def steps(self) -> list[tuple[int, Path]]:
        return self.scan()[0]

    def links(self) -> dict[str, str]:
        return self.scan()[1]

    def _recorded(self) -> dict[int, Record]:
        """Each step directory's record, read from its manifest once (unreadable ones have none)."""
        if self._records is None:
            self._records = {}
            for step, directory in self.steps():
                with contextlib.suppress(CheckpointError):
                    self._records[step] = _record(cd.CheckpointDir(directory).manifest())
        return self._records

    def newest_valid(self, parts: Mapping | None = None) -> tuple[cd.Checkpoint | None, Skipped]:
        """The newest checkpoint that verifies (and fits `parts`), and (directory, what, why) of each newer one."""
        skipped: Skipped = []
        for _, directory in reversed(self.steps()):
            try:
                return cd.CheckpointDir(directory).load(parts), skipped
            except MisfitError as e:
                misfit = "a checkpoint that verifies but does not fit this config"
                skipped.append((directory, misfit, str(e)))
            except CheckpointError as e:
                skipped.append((directory, "a damaged checkpoint", str(e)))
        return None, skipped

    def newest_manifest(self) -> tuple[Path, dict] | None:
        """The newest step directory and its manifest, the rest unread (None: no step, or its manifest is bad)."""
        steps = self.steps()
        try:
            return (steps[-1][1], cd.CheckpointDir(steps[-1][1]).manifest()) if steps else None
        except CheckpointError:
            return None

    def save(self, step: int, tree: dict, fields: dict) -> cd.Checkpoint:
        """Write and record this step's checkpoint, replacing whatever (another run's, a damaged one) is there."""
        atomic.ensure_dirs(self.root.parent, self.root.name)
        directory = self.root / cd.step_dir_name(step)
        manifest = cd.CheckpointDir(directory).write(tree, fields, replace=True)
        self._recorded()[step] = _record(manifest)
        return cd.Checkpoint(directory, manifest, tree, fields[mf.DATA_FACTS])

    def retain(self, policy: Policy, links: dict, upto: int, lineage: str, named=()) -> None:
        """Point each link at what its policy selects, then delete the step directories no policy keeps, of the
        history `lineage` up to step `upto` only; an undeclared link keeps its target, a retired `named` one goes."""
        present_steps, present_links = self.scan()  # once: linking changes no step directory
        recorded = sorted(self._recorded().items())
        records = [r for _, r in recorded if r.step <= upto and r.lineage == lineage]
        targets = {n: select_one(p, records) for n, p in links.items()}
        targets |= {k: s for n in named for k, s in n.links(records).items() if k not in links}
        others = {k: cd.step_number(t) for k, t in present_links.items() if k not in links}
        given = {(n.name(r), r.step) for n in named for r in records}
        retired = {k for k, s in others.items() if (k, s) in given and k not in targets}
        orphans = {s for k, s in others.items() if k not in retired}
        keep = AnyOf((policy, *links.values())).keep(records) | orphans
        for name, step in targets.items():
            if step is not None and present_links.get(name) != cd.step_dir_name(step):
                where = f"before {name} link" if name in links else "before a named link"
                killpoint.point("save", where)
                atomic.replace_link(self.root / name, cd.step_dir_name(step))
        for name in retired:  # before its step directory: a link never names a missing step
            killpoint.point("save", "before a name is retired")
            os.unlink(self.root / name)
        if retired:
            atomic.fsync_dir(self.root)
        for step, directory in present_steps:
            if step not in keep and step in {r.step for r in records}:
                killpoint.point("save", "before delete")
                atomic.discard_dir(directory)
                self._recorded().pop(step, None)

    def link_dir(self, name: str) -> Path | None:
        """The step directory a link points at, if the link exists and names one here."""
        target = self.links().get(name)
        return self.root / target if target and (self.root / target).is_dir() else None

    def link_step(self, name: str) -> int | None:
        target = self.links().get(name)
        return cd.step_number(target) if target else None
