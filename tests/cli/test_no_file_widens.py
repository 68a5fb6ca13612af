"""No file widens what code may run (pipeline/config/targets.py): the allow-list's inputs are the shipped conf/, the
current command line and the search paths given on it. For every entry point of the package (every module with a
`__main__` block, found on disk: a new tool without a case here fails `test_every_entry_point_has_a_case`), every
file it reads is planted with a search path to the attacker's config directory, whose `model/evil.yaml` is
`io.FileIO` opening a sentinel outside the tree with `mode: w` (which truncates it): the run's
.hydra/overrides.yaml, every checkpoint's manifest (its hashes recomputed), an archive's recovery.json and
MANIFEST.json (recomputed), a verifier's config.json. The tool refuses (exit 1 or 2, one line on stderr), or, for
one that builds nothing a file names, runs as it would; either way the sentinel is byte-identical."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, PROJECT_ROOT, env_for_subprocess, the_run

from pipeline.config.identity import config_hash, semantic_hash

pytestmark = pytest.mark.slow
BASE = (*KERNODECK, "trainer.max_steps=4", "checkpoint=every_n_steps", "checkpoint.every_steps=2")


def entry_points() -> set[str]:
    """`python -m` names of every module of the package that runs as a program."""
    out = set()
    for path in (PROJECT_ROOT / "pipeline").rglob("*.py"):
        if not re.search(r'^if __name__ == "__main__"', path.read_text(), re.M):
            continue
        parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__main__" else parts
        out.add(
            ".".join(p for i, p in enumerate(parts) if not (i == 1 and p == "cli"))
        )  # pipeline/cli/x: pipeline.x
    return out


class Scene:
    """A copy of a finished run, the attacker's config directory and the sentinel it would truncate."""

    def __init__(self, finished: Path, tmp: Path):
        self.tmp, self.out = tmp, tmp / "out"
        shutil.copytree(finished, self.out, symlinks=True)
        self.run = the_run(self.out)
        self.ckpt = self.run / "checkpoints" / "final"
        self.sentinel = tmp / "outside" / "sentinel.txt"
        self.sentinel.parent.mkdir()
        self.sentinel.write_text("precious\n")
        self.evil = tmp / "evil"
        (self.evil / "model").mkdir(parents=True)
        (self.evil / "model" / "evil.yaml").write_text(
            f"_target_: io.FileIO\nfile: {self.sentinel}\nmode: w\n"
        )
        self.searchpath = f"hydra.searchpath=[file://{self.evil}]"
        self.node = {"_target_": "io.FileIO", "file": str(self.sentinel), "mode": "w"}
        (tmp / "cwd").mkdir()

    def plant(
        self, root: Path, manifests: bool = True, overrides: tuple[str, ...] | None = None
    ) -> None:
        """The search path (and the class it allows) in every file under root a tool reads."""
        overrides = (
            (
                self.searchpath,
                "model=evil",
                *(f"~model.{k}" for k in ("hidden", "activation", "dropout")),
            )
            if overrides is None
            else overrides
        )  # kernodeck's MLP keys deleted: io.FileIO takes none of them
        for hydra_dir in root.rglob(".hydra"):
            path = hydra_dir / "overrides.yaml"
            path.write_text(path.read_text() + "".join(f"- {json.dumps(o)}\n" for o in overrides))
        for path in root.rglob("manifest.json") if manifests else ():
            m = json.loads(path.read_text())
            m["config"]["model"] = dict(self.node)
            m["config_hash"] = config_hash(m["config"])
            m["semantic_config_hash"] = semantic_hash(m["config"], m["sources"])
            path.write_text(json.dumps(m))
        if (root / "recovery.json").exists():
            r = json.loads((root / "recovery.json").read_text())
            for run in r["exported"]["runs"].values():
                run["resume_overrides"] = [self.searchpath, *run["resume_overrides"]]
            (root / "recovery.json").write_text(json.dumps(r))
        if (
            root / "MANIFEST.json"
        ).exists():  # an archive's own listing, recomputed: it passes as undamaged
            listing = json.loads((root / "MANIFEST.json").read_text())
            for rel in listing["files"]:
                data = (root / rel).read_bytes()
                listing["files"][rel] = {
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            (root / "MANIFEST.json").write_text(json.dumps(listing))

    def run_tool(self, module: str, *args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", module, *map(str, args)],
            cwd=self.tmp / "cwd",
            env=env_for_subprocess(),
            capture_output=True,
            text=True,
        )

    def archive_of(self, run: Path, dest: Path) -> Path:
        proc = self.run_tool("pipeline.archive", run, dest)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return dest


# -- each entry point: (what it is given, after planting) -> args; "refused" or "runs" ------------------------


def show(s: Scene):
    s.plant(s.out)
    return [s.run], "refused"


def evaluate(s: Scene):
    s.plant(s.out)
    return [s.ckpt, f"paths.output_dir={s.tmp / 'scratch'}"], "refused"


def sample(s: Scene):
    s.plant(s.out)
    return [s.ckpt, "prompt=a", f"paths.output_dir={s.tmp / 'scratch'}"], "refused"


def export_hf(s: Scene):
    s.plant(s.out)
    return [s.ckpt, s.tmp / "hf"], "refused"


def register(s: Scene):
    s.plant(s.out)
    return [s.ckpt, "evil", "--tracking-uri", f"sqlite:///{s.tmp / 'registry.db'}"], "refused"


def archive_a_planted_run(s: Scene):
    s.plant(s.out)
    return [s.run, s.tmp / "dest"], "refused"


def archive_a_run_whose_overrides_name_a_search_path(s: Scene):
    """Its checkpoints are clean: only the resume proof, run on its own overrides, would build the planted class."""
    s.plant(s.out, manifests=False)
    return [s.run, s.tmp / "dest"], "refused"


def archive_a_run_whose_overrides_name_the_class(s: Scene):
    """No search path: the overrides name io.FileIO themselves (a stage), as a command line may."""
    s.plant(
        s.out,
        manifests=False,
        overrides=(f"+stages.evil={{_target_:io.FileIO,file:'{s.sentinel}',mode:w}}",),
    )
    return [s.run, s.tmp / "dest"], "refused"


def archive_check(s: Scene):
    dest = s.archive_of(s.run, s.tmp / "dest")
    s.plant(dest)
    return ["--check", dest], "refused"


def reindex(s: Scene):
    s.plant(s.out)
    return [
        s.out,
        "--tracking-uri",
        f"sqlite:///{s.tmp / 'index.db'}",
    ], "runs"  # indexes: builds nothing


def roundtrip(s: Scene):
    s.plant(s.out)
    return [*BASE, f"paths.output_dir={s.out}", "--steps", "2"], "runs"  # reads only what it writes


def verify(s: Scene):
    s.plant(s.out)
    return [*BASE, f"paths.output_dir={s.out}", "verify.cut=2", "verify.steps=4"], "runs"


def verify_worker(s: Scene):
    config = json.loads((s.ckpt / "manifest.json").read_text())["config"]
    config["model"] = dict(s.node)
    (s.tmp / "config.json").write_text(json.dumps(config))
    return [
        "--config",
        s.tmp / "config.json",
        "--mode",
        "continuous",
        "--cut",
        "1",
        "--steps",
        "2",
        "--out",
        s.tmp / "worker",
    ], "refused"


def resume_auto(s: Scene):
    s.plant(s.out)
    return [
        *BASE,
        f"paths.output_dir={s.out}",
        "hydra/job_logging=disabled",
    ], "refused"  # the same run, again


def resume_source(s: Scene):
    s.plant(s.out)
    return [
        *BASE,
        f"paths.output_dir={s.tmp / 'new'}",
        f"resume.source={s.ckpt}",
        "trainer.max_steps=6",
        "resume.allow_changes=[trainer.max_steps]",
        "hydra/job_logging=disabled",
    ], "refused"


CASES = {
    "pipeline.show": [show],
    "pipeline.evaluate": [evaluate],
    "pipeline.sample": [sample],
    "pipeline.export_hf": [export_hf],
    "pipeline.register": [register],
    "pipeline.archive": [
        archive_a_planted_run,
        archive_a_run_whose_overrides_name_a_search_path,
        archive_a_run_whose_overrides_name_the_class,
        archive_check,
    ],
    "pipeline.reindex": [reindex],
    "pipeline.roundtrip": [roundtrip],
    "pipeline.verify": [verify],
    "pipeline.verify.worker": [verify_worker],
    "pipeline": [resume_auto, resume_source],
}
# Entry points that read no config at all, and why.
NO_CONFIG = {
    "pipeline.tracking.agent": "serves the jobs' mlflow events over a socket; it reads no config"
}


def test_every_entry_point_has_a_case():
    assert entry_points() == set(CASES) | set(NO_CONFIG)


FINISHED = BASE  # conftest's `finished` runs it


@pytest.mark.parametrize(
    "module, case",
    [(m, c) for m, cs in CASES.items() for c in cs],
    ids=[f"{m}:{c.__name__}" for m, cs in CASES.items() for c in cs],
)
def test_no_file_widens_what_may_run(finished, tmp_path, module, case):
    s = Scene(finished, tmp_path)
    args, expected = case(s)
    proc = s.run_tool(module, *args)
    assert s.sentinel.read_bytes() == b"precious\n", proc.stdout + proc.stderr
    if expected == "runs":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    assert proc.returncode in (1, 2), proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    if module == "pipeline.archive" and case is not archive_a_run_whose_overrides_name_the_class:
        # the archive says which search path it was made with, to be given on the command line if trusted
        assert (
            f"was made with {s.searchpath}; give it on the command line if you trust it"
            in proc.stderr
        )
    assert not (tmp_path / "dest").exists() or case is archive_check  # nothing published


def test_the_archives_search_path_given_on_the_command_line_is_the_users_choice(finished, tmp_path):
    """The same archive, its search path given by the user: the class passes the allow-list (the user's decision),
    and is refused before it is built by what every model must take (the live-argument interface)."""
    s = Scene(finished, tmp_path)
    dest = s.archive_of(s.run, tmp_path / "dest")
    s.plant(dest)
    proc = s.run_tool("pipeline.archive", "--check", dest, s.searchpath)
    out = proc.stdout + proc.stderr
    assert "model._target_=io.FileIO takes no 'spec'" in out and "live-argument interface" in out, (
        out
    )
    assert "give it on the command line if you trust it" not in out  # past the allow-list
    assert s.sentinel.read_bytes() == b"precious\n", out  # never built
    assert proc.returncode == 1
