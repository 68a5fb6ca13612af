"""`python -m pipeline.archive SOURCE DEST`: a run, sweep or checkpoint copied to DEST, verified, reloaded and resumed
there (docs/archive.md: built as a hidden temporary, published only if every check passed)."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra.utils import get_class

from pipeline.checkpoint.directory import STEP_DIR, CheckpointDir, step_dir_name
from pipeline.checkpoint.store import CheckpointStore
from pipeline.cli.export_hf import gpt2_shaped
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, CommandError
from pipeline.config.identity import run_name
from pipeline.config.targets import shipped
from pipeline.data.corpus import verify_corpus
from pipeline.files import atomic, jsonio, names, reading
from pipeline.files import listing as files_listing
from pipeline.files.limits import MAX_ARCHIVE_LISTING, MAX_CORPUS_JSON, MAX_SMALL, MAX_SOURCE_FILE
from pipeline.run.directory import RunDir
from pipeline.run.signals import command, run_command
from pipeline.verify import chaos

NAME = "pipeline.archive"
SELECTIONS = ("best", "final", "newest")

INTERRUPTED = "no archive was published (its hidden temporary is removed or ignored)"


class BadSource(CommandError):
    """SOURCE (or DEST) cannot be archived: one line, exit 2."""


class RunPlan:
    """One run to archive: where it lies, which checkpoints (each verified: a damaged one is bad input), its links."""

    def __init__(self, name: str, run_dir: Path | None, ckpts: dict, links: dict[str, str]):
        self.name, self.run_dir, self.checkpoints, self.links = name, run_dir, ckpts, links
        at = run_dir or next(iter(ckpts.values()))
        # each becomes one entry under DEST
        named = [("run directory name", name), *(("step name", n) for n in ckpts)]
        for what, value in [*named, *(("link name", n) for n in links)]:
            names.checked(value, f"{at}: {what}", reserve=0)
        self.manifests = {n: CheckpointDir(p).load().manifest for n, p in ckpts.items()}
        self.newest = self.manifests[max(self.manifests, key=lambda n: self.manifests[n]["step"])]


def _kind(path: Path) -> str:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadSource(f"{path}: does not exist") from None
    # a link the user typed is followed, as its target could be typed instead
    st = os.stat(path) if stat.S_ISLNK(st.st_mode) else st
    if not stat.S_ISDIR(st.st_mode):
        what = reading.kind_of(st)
        raise BadSource(f"{path}: is {what}, not a run, sweep or checkpoint directory")
    if CheckpointDir(path).exists():
        return "checkpoint"
    if RunDir(path).is_run():
        return "run"
    up = RunDir(path.parent)
    if up.store.root == path and up.status_path.is_file():
        raise BadSource(f"{path}: a run's store of checkpoints; give the run directory {up.path}")
    if (path / "jobs").is_dir() and (path / "sweep.json").is_file():
        return "sweep"
    what = "a sweep directory (no sweep.json and jobs/) or a checkpoint (no manifest.json)"
    raise BadSource(f"{path}: not a run directory (no checkpoints/ or run.json), {what}")


def _select(store: CheckpointStore, which: str) -> tuple[dict[str, Path], dict[str, str]]:
    # a stray link or file in checkpoints/ is refused here (UnsafePathError)
    steps, links = store.scan()
    if not steps:
        raise BadSource(f"{store.root}: no checkpoints to archive")
    by_name = {d.name: d for _, d in steps}
    chosen = set(by_name) if which == "all" else set()
    for want in which.split(",") if which != "all" else ():
        if want == "newest":  # the newest a resume continues from: before a finished run's final
            finished = links.get("final") == steps[-1][1].name and len(steps) > 1
            chosen.add(steps[-2 if finished else -1][1].name)
        elif want in links and links[want] in by_name:
            chosen.add(links[want])
    return {n: by_name[n] for n in sorted(chosen)}, {k: t for k, t in links.items() if t in chosen}


def plan(source: Path, which: str, kind: str | None = None) -> list[RunPlan]:
    """The runs SOURCE (a `kind`) stands for, each with the checkpoints to keep (every one verified, read-only)."""
    kind = kind or _kind(source)
    if kind == "sweep":
        from pipeline.sweep.summary import read_jobs

        runs_dir = source.parent.parent / "runs"  # source: <output_dir>/sweeps/<name>-<id>/
        jobs = read_jobs(source).values()
        runs = sorted({Path(j["run_dir"]).name for j in jobs if isinstance(j.get("run_dir"), str)})
        if not runs:
            raise BadSource(f"{source}: a sweep none of whose jobs/*.json names a run directory")
        plans = []
        for n in runs:
            names.checked(n, f"{source / 'jobs'}: a run_dir's name", reserve=0)
            if not (at := runs_dir / n).is_dir():
                raise BadSource(f"{at}: the run of a job of sweep {source.name} is not there")
            plans += plan(at, which)
        return plans
    if kind == "run":
        run_dir = Path(os.path.realpath(source))
        return [RunPlan(run_dir.name, run_dir, *_select(RunDir(run_dir).store, which))]
    directory = CheckpointDir(source).resolved()
    if STEP_DIR.match(directory.name) and (in_run := RunDir.of_checkpoint(directory)) is not None:
        links = {k: t for k, t in in_run.store.links().items() if t == directory.name}
        return [RunPlan(in_run.path.name, in_run.path, {directory.name: directory}, links)]
    # the run's directory name comes from it: one name, inside DEST
    m = CheckpointDir(directory).manifest()
    names.checked(m["config"].get("name"), f"{directory}: its manifest's config.name")
    name = run_name(m["config"], m["sources"], m["lineage"])
    return [RunPlan(name, None, {step_dir_name(m["step"]): directory}, {})]


class Builder:
    """DEST being built in its temporary: every file copied with its hash, every link, and what each should be."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, dict] = {}  # relative path -> {"size", "sha256"} as copied
        self.expected: dict[str, tuple[dict, str]] = {}  # rel -> (entry, the manifest saying so)
        self.links: dict[str, str] = {}

    def place(self, rel: str) -> Path:
        """root/rel with its directories made, every part of `rel` one name (names.problem): never outside root."""
        *parents, name = rel.split("/")
        where = f"{self.root}: an entry of {'/'.join(parents) or 'the archive'}"
        names.checked(name, where, reserve=0)
        return atomic.ensure_dirs(self.root, *parents) / name

    def copy(self, src: Path, rel: str, limit: int, expected=None, witness="", follow=False):
        """src's bytes into a new file at rel (never through a link), fsynced, and hashed as they are copied."""
        entry = reading.copy_new(src, self.place(rel), limit, follow=follow)
        if expected is not None:
            why = f"its bytes differ from {witness} (changed or damaged while being archived)"
            if (entry["size"], entry["sha256"]) != (expected["size"], expected["sha256"]):
                raise BadSource(f"{src}: {why}")
            self.expected[rel] = (expected, witness)
        self.files[rel] = entry

    def write(self, rel: str, data: bytes) -> None:
        entry = atomic.write_new(self.place(rel), data)
        if rel not in ("MANIFEST.json", "recovery.json"):
            self.files[rel] = entry

    def link(self, rel: str, target: str) -> None:
        os.symlink(target, self.place(rel))
        self.links[rel] = target


def archive_run(b: Builder, p: RunPlan, with_data: bool) -> dict:
    """Copy one run into b.root/runs/<name>/; returns what was exported."""
    base = f"runs/{p.name}"
    store = RunDir(b.root / base).store.root
    atomic.ensure_dirs(b.root, *store.relative_to(b.root).parts)
    # exactly the listed files, each hashed as it is copied
    for name, directory in p.checkpoints.items():
        listed = p.manifests[name]["files"]
        for fn, entry in CheckpointDir(directory).copy_to(store / name, p.manifests[name]).items():
            rel = (store / name / fn).relative_to(b.root).as_posix()
            b.files[rel] = entry
            if fn in listed:
                b.expected[rel] = (listed[fn], f"the manifest of {directory}")
    for link, target in sorted(p.links.items()):  # relative, beside its step directory
        b.link((store / link).relative_to(b.root).as_posix(), target)
    for rel, path, limit in RunDir(p.run_dir).records() if p.run_dir is not None else ():
        b.copy(path, f"{base}/{rel}", limit)
    data_hash, sources = p.newest["data_manifest_hash"], dict(p.newest["sources"])
    data = p.newest["config"]["data"]
    corpus = RunDir(p.run_dir).corpus(data_hash) if p.run_dir is not None else None
    identity = dict(data_manifest_hash=data_hash, sources=sources, data=data)
    identity |= dict(corpus=corpus.name if corpus else None, data_archived=with_data)
    if sources and not with_data:
        keys = ", ".join(f"{k}={data.get(k.split('.', 1)[1])}" for k in sources)
        why = "which its config cannot regenerate: give --with-data to archive it"
        raise BadSource(f"run {p.name} was trained on {keys}, {why}")
    if corpus is not None:
        man = corpus / "MANIFEST.json"
        hashed = {"size": os.path.getsize(man), "sha256": data_hash}
        witness = "the checkpoints' data_manifest_hash"
        b.copy(man, f"{base}/corpus-MANIFEST.json", MAX_SMALL, hashed, witness)
    if with_data:
        # asked of its class only if we ship it: a file imports nothing else
        target = str(data.get("_target_", ""))
        lacking = corpus is None and data_hash and target in shipped()
        if lacking and getattr(get_class(target), "keeps_corpus", False):
            sha = f"MANIFEST.json sha256 {data_hash[:12]}"
            where = "is not beside its run, under <output_dir>/data/; --with-data needs it there"
            raise BadSource(f"run {p.name}: its corpus ({sha}) {where}")
        at = f"data/{corpus.name}" if corpus is not None else ""
        if corpus is not None and f"{at}/MANIFEST.json" not in b.files:
            for fn, entry in sorted(verify_corpus(corpus)[0]["files"].items()):
                size = entry["size"] if "size" in entry else entry["bytes"]  # a corpus says bytes
                listed = {"size": size, "sha256": entry["sha256"]}
                b.copy(corpus / fn, f"{at}/{fn}", size, listed, f"{corpus / 'MANIFEST.json'}")
            b.copy(man, f"{at}/MANIFEST.json", MAX_CORPUS_JSON, hashed, "data_manifest_hash")
        archived, witness = {}, "the checkpoints' sources"
        for key, sha in sorted(sources.items()):
            src = Path(str(data.get(key.split(".", 1)[1]))).expanduser()
            rel = f"sources/{sha[:12]}-{src.name}"
            if rel not in b.files:
                try:
                    listed = {"size": os.path.getsize(src), "sha256": sha}
                    b.copy(src, rel, MAX_SOURCE_FILE, listed, witness, follow=True)
                except FileNotFoundError:
                    why = "(the file it was trained on) is not there; archive it where the file is"
                    raise BadSource(f"run {p.name}: {key}={src} {why}") from None
            archived[key] = rel
        identity["sources_archived"] = archived
    b.write(f"{base}/data-identity.json", jsonio.dumps(identity))
    links = {n: sorted(k for k, t in p.links.items() if t == n) for n in p.manifests}
    ms = p.manifests
    ckpts = {n: {"step": m["step"], "tags": m["tags"], "links": links[n]} for n, m in ms.items()}
    shown = {k: identity[k] for k in ("data_manifest_hash", "sources", "corpus")}
    return {"checkpoints": dict(sorted(ckpts.items())), "data": shown, "with_data": bool(with_data)}


def run_overrides(run: Path) -> list[str] | None:
    """The overrides the run was last started with (.hydra/overrides.yaml), or None if it has none."""
    import yaml

    path = RunDir(run).overrides_path
    if not path.is_file():
        return None
    value = yaml.safe_load(reading.read_bytes(path, MAX_SMALL))
    return [str(v) for v in value] if isinstance(value, list) else None


def _trust_hint(root: Path, run: Path, extra: list[str]) -> str:
    """The search path the archive says `run` was made with, if not on the command line: named in a refusal only."""
    said = list(run_overrides(run) or [])
    with contextlib.suppress(Exception):
        exported = jsonio.read(root / "recovery.json", MAX_SMALL)["exported"]
        said += [str(o) for o in exported["runs"][run.name]["resume_overrides"]]
    said = [o for o in said if o.lstrip("+").startswith("hydra.searchpath=")]
    said = [" ".join(o.split())[:300].lstrip("+") for o in said]
    if (searchpath := next((o for o in said if o not in extra), None)) is None:
        return ""
    return f"; this archive's run {run.name} was made with {searchpath}; give it on the command line if you trust it"


def restore_all(root: Path, extra: list[str]) -> list[dict]:
    """Every archived checkpoint restored as a resume would; what it may build is the command line's (`extra`) alone."""
    from pipeline.run.trained import UnknownTargetError, restore_checkpoint

    checks = []
    for run in sorted((root / "runs").iterdir()):
        for step_dir in sorted(d for d in RunDir(run).store.root.iterdir() if not d.is_symlink()):
            try:
                passed, detail = True, f"step {restore_checkpoint(step_dir, extra)[0]['step']}"
            except Exception as e:
                hint = _trust_hint(root, run, extra) if isinstance(e, UnknownTargetError) else ""
                passed, detail = False, str(e).splitlines()[0] + hint
            checks.append(_check(f"restore {step_dir.relative_to(root)}", passed, detail))
    return checks


def _check(check: str, passed, detail) -> dict:
    return {"check": check, "passed": passed, "detail": detail}


def untrusted(args: list[str], extra: list[str], root: Path, run: Path) -> str | None:
    """Why the proof's `args` would build what the command line does not allow (a flag, hydra.*, a target), or None."""
    from pipeline.config import targets
    from pipeline.config.compose import compose, to_plain
    from pipeline.config.errors import ConfigError, error_line

    where = f"run {run.name}'s .hydra/overrides.yaml or data-identity.json"
    try:
        if bad := next((a for a in args if a not in extra and a.lstrip().startswith("-")), None):
            return f"{where} gives {bad[:200]!r}, a flag: only the command line may give one"
        for o in targets.parse_overrides([a for a in args if a not in extra]):
            if o.key_or_group.startswith("hydra"):
                said = f"{o.input_line[:200]!r}: only the command line may give hydra.*"
                return f"{where} gives {said}{_trust_hint(root, run, extra)}"
        targets.check(to_plain(compose(args)), targets.allowed(tuple(extra)))
    except targets.UnknownTarget as e:
        return f"{where}: {e}{_trust_hint(root, run, extra)}"
    except ConfigError as e:
        return f"{where}: {e}"
    except Exception as e:
        return f"{where}: does not compose: {error_line(e)}"
    return None


def _resume_overrides(run: Path, root: Path, extra: list[str]) -> list[str]:
    """The run's own overrides, the archive's search path added, paths/resume/tracking dropped, its data files in."""
    dropped = ("paths.", "resume", "tracking", "data.path=")
    kept = [o for o in run_overrides(run) or [] if not o.lstrip("+~").startswith(dropped)]
    kept += [o for o in extra if o not in kept]
    archived = jsonio.read(run / "data-identity.json", MAX_SMALL).get("sources_archived") or {}
    return kept + [f"{key}={root / rel}" for key, rel in archived.items()]


def resume_proof(root: Path, dest: Path, run: Path, scratch: Path, extra: list[str]) -> dict:
    """A fresh `python -m pipeline` resumed from the newest archived step before the end, compared bit for bit."""
    if run_overrides(run) is None:
        detail = "no .hydra/overrides.yaml (a checkpoint archived without its run): not resumed"
        return {"run": run.name, "passed": None, "detail": detail}
    store = RunDir(run).store
    steps, archived = store.steps(), chaos.metric_lines(run)
    end = max([steps[-1][0], *(ln["step"] for ln in archived)])
    candidates = [(s, d) for s, d in steps if s < end]
    # a fork of the run's end would train nothing (refused); its restore is checked already
    if not candidates:
        detail = f"the original recorded nothing after step {steps[-1][0]}: nothing later to resume"
        return {"run": run.name, "passed": None, "step_recovered": steps[-1][0], "detail": detail}
    step, source = candidates[-1]
    args = [*_resume_overrides(run, root, extra), f"resume.source={source}"]
    args += [f"paths.output_dir={scratch / 'out'}", "tracking=none", "trainer.progress_bar=false"]
    shown = " ".join(args).replace(str(root), str(dest)).replace(str(scratch), "<scratch>")
    # the child takes them as its command line
    if (problem := untrusted(args, extra, root, run)) is not None:
        return {"run": run.name, "passed": False, "step_recovered": step, "detail": problem}
    # subprocess.run (chaos.run) kills the child on any exception (a signal's included) before it is raised
    proc = chaos.run([sys.executable, "-m", "pipeline", *args], cwd=scratch)
    result = {"run": run.name, "from": source.relative_to(root).as_posix(), "step_recovered": step}
    result |= {"command": f"python -m pipeline {shown}", "exit": proc.returncode}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return result | dict(passed=False, detail=last)
    (resumed_run,) = [p for p in (scratch / "out" / "runs").iterdir() if p.is_dir()]
    # a preempted run goes on past end
    got = [ln for ln in chaos.metric_lines(resumed_run) if step < ln["step"] <= end]
    want = [ln for ln in archived if ln["step"] > step]
    compared: dict[str, Any] = {"metrics_lines_after_step": len(want), "metrics_equal": got == want}
    stores = (store, RunDir(resumed_run).store)
    finals = [d for s in stores if (d := s.link_dir("final")) is not None]
    if len(finals) == 2 and step < end:
        a, bb = (CheckpointDir(d).manifest() for d in finals)
        hashes, mine = {n: e["sha256"] for n, e in bb["files"].items()}, a["files"]
        compared["final_step"] = a["step"]
        compared["final_files_equal"] = {n: e["sha256"] == hashes.get(n) for n, e in mine.items()}
    ok = compared["metrics_equal"] and all(compared.get("final_files_equal", {}).values())
    result.update(passed=bool(ok), compared=compared, to_step=end)
    return result


def checks_on(root: Path, dest: Path, b: Builder | None, extra: list[str], prove: bool) -> dict:
    """Every check of the archive at root (its final name `dest`), from its own bytes."""
    listing = jsonio.read(root / "MANIFEST.json", MAX_ARCHIVE_LISTING)
    # every file listed there with its size and sha256, every link as listed, nothing else
    files, links, ignore = listing["files"], listing["links"], ("recovery.json",)
    said = files_listing.problems(root, files, "MANIFEST.json", links=links, ignore=ignore)
    problem = next((f"{rel}: {reason}" for rel, reason in said), None)
    counted = f"{len(files)} files, {len(links)} links"
    checks = [_check("sizes and sha256 against MANIFEST.json", not problem, problem or counted)]
    # what lies there is not the archive MANIFEST.json lists: nothing in it is read as a run
    if problem:
        return {"checks": checks, "resume": [], "all_checks_passed": False}
    if b is not None:
        got = {r: e["sha256"] for r, e in files.items()}
        wrong = [r for r, (e, _) in b.expected.items() if got.get(r) != e["sha256"]]
        detail = f"{len(b.expected)} files listed by checkpoint and corpus manifests"
        detail = f"{wrong[0]} differs from {b.expected[wrong[0]][1]}" if wrong else detail
        checks.append(_check("sizes and sha256 against the source manifests", not wrong, detail))
    checks += restore_all(root, extra)
    proofs, prefix = [], "pipeline-archive-resume-"
    for run in sorted((root / "runs").iterdir()) if prove else ():
        with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as scratch:
            proofs.append(p := resume_proof(root, dest, run, Path(scratch), extra))
        if p["passed"] is not None:
            what = f"resume {p['run']} from step {p.get('step_recovered')}"
            checks.append(_check(what, p["passed"], p.get("detail") or p.get("compared")))
    passed = all(c["passed"] for c in checks)
    return {"checks": checks, "resume": proofs, "all_checks_passed": passed}


def readme(dest: Path, exported: dict) -> str:
    text = f"""# Archive {dest.name}

Made by `python -m pipeline.archive`. Every file is listed with its size and sha256 in MANIFEST.json;
recovery.json holds the checks run on this directory alone and the resume proof. Re-check it with
`python -m pipeline.archive --check {dest}`. Give `paths.output_dir=SCRATCH` to the commands below so
that a regenerated corpus goes there, not into this archive.
"""
    for name, run in sorted(exported["runs"].items()):
        ck, d, over = run["checkpoints"], run["data"], run["resume_overrides"]
        newest = (order := sorted(ck, key=lambda n: ck[n]["step"]))[-1]
        # as the proof does
        resume_from = order[-2] if len(order) > 1 and "final" in ck[newest]["links"] else newest
        best = "best" if any("best" in c["links"] for c in ck.values()) else newest
        at = RunDir(dest / "runs" / name).store.root
        sp = (" " + " ".join(o for o in over if o.startswith("hydra.searchpath="))).rstrip()
        tagged = {n: f", {'/'.join(c['links'])}" if c["links"] else "" for n, c in ck.items()}
        listed = ", ".join(f"{n} (step {c['step']}{tagged[n]})" for n, c in sorted(ck.items()))
        sources = f"{d['sources'] or '-'}{' (archived under sources/ and data/)' if run['with_data'] else ''}"
        generates = f"""python -m pipeline.sample {at}/final prompt="the" max_new_tokens=20 paths.output_dir=SCRATCH
python -m pipeline.export_hf {at}/final HF_DIR
"""
        resume = f"python -m pipeline {' '.join(over)} resume.source={at}/{resume_from} paths.output_dir=SCRATCH"
        how = f"repeats the steps after {resume_from} of the finished run, to its final bytes"
        how = how if resume_from != newest else "continues the run from its newest checkpoint"
        text += f"""
## {name}

Checkpoints: {listed}
Data: data_manifest_hash {d["data_manifest_hash"]}, corpus {d["corpus"] or "-"}, sources {sources}.

```bash
python -m pipeline.show {dest}/runs/{name}{sp}
python -m pipeline.evaluate {at}/{best} paths.output_dir=SCRATCH{sp}
{generates if run.get("generates") else ""}{resume.replace("  ", " ")}
```

The resume {how}; `python -m pipeline.archive --check` re-verifies every byte.
"""
    return text


def _failed(checks: list[dict]) -> dict | None:
    """Every check printed, ok or FAIL; the first that failed, if one did."""
    for c in checks:
        print(f"{'ok  ' if c['passed'] else 'FAIL'} {c['check']}: {c['detail']}")
    return next((c for c in checks if not c["passed"]), None)


def build_archive(source: Path, dest: Path, which: str, with_data, extra: list, argv: list) -> int:
    """DEST built in its temporary, checked, published; missing parents made (mkdir -p), gone if none is published."""
    if os.path.lexists(dest):
        never = "an archive is never overwritten or merged into (choose a new DEST)"
        raise BadSource(f"{dest}: already exists; {never}")
    real_src, real_dest = os.path.realpath(source), os.path.realpath(dest)
    if real_dest == real_src or real_dest.startswith(real_src.rstrip("/") + "/"):
        raise BadSource(f"{dest}: inside SOURCE {source}; archive elsewhere")
    made, keep_tmp = atomic.NewDirs(dest.parent), False
    tmp: Path | None = None
    try:
        try:
            os.makedirs(dest.parent, exist_ok=True)
        except OSError as e:
            raise BadSource(f"{dest.parent}: cannot be made for DEST ({e.strerror or e})") from None
        stale = f"{atomic.TMP_PREFIX}{dest.name}-"
        for p in sorted(p for p in dest.parent.iterdir() if p.name.startswith(stale)):
            ignoring = f"{NAME}: ignoring {p}, the temporary of an interrupted archive (remove it)"
            print(ignoring, file=sys.stderr)
        plans = plan(source, which, kind := _kind(source))
        if len({p.name for p in plans}) != len(plans):
            raise BadSource(f"{source}: two runs of the same name")
        b = Builder(tmp := atomic.new_temp_dir(dest.parent, dest.name))
        exported: dict[str, Any] = {"runs": {}}
        for run_plan in plans:
            exported["runs"][run_plan.name] = run = archive_run(b, run_plan, with_data)
            overrides = _resume_overrides(tmp / "runs" / run_plan.name, tmp, extra)
            run["resume_overrides"] = [o.replace(str(tmp), str(dest)) for o in overrides]
            model = run_plan.newest["config"]["model"]
            run["model"], run["generates"] = model.get("_target_"), gpt2_shaped(model)
        if kind == "sweep":  # its own records too: multirun.yaml, sweep.json, jobs/*.json, results
            name = Path(os.path.realpath(source)).name
            tops = [f for f in sorted(source.iterdir()) if not f.is_dir() or f.is_symlink()]
            # each a regular file: b.copy refuses the rest
            for f in [*tops, *sorted((source / "jobs").iterdir())]:
                b.copy(f, f"sweeps/{name}/{f.relative_to(source).as_posix()}", MAX_SMALL)
            exported["sweep"] = name
        b.write("README.md", readme(dest, exported).encode())
        b.write("MANIFEST.json", jsonio.dumps({"files": b.files, "links": b.links}))
        result = checks_on(tmp, dest, b, extra, prove=True)
        exported |= dict(files=len(b.files), bytes=sum(e["size"] for e in b.files.values()))
        report = dict(archive=str(dest), source=str(source), **result, exported=exported)
        report["command"] = "python -m pipeline.archive " + " ".join(argv)
        report["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        b.write("recovery.json", jsonio.dumps(report))
        atomic.fsync_dir(tmp)
        if failed := _failed(result["checks"]):
            keep_tmp = True
            why = f"{failed['check']}: {failed['detail']}"
            print(f"{NAME}: check failed: {why}; nothing published (see {tmp})", file=sys.stderr)
            return EXIT_ERROR
        atomic.publish_dir(tmp, dest)
        counts = f"{exported['files']} files, {exported['bytes']} bytes"
        print(f"archived {source} to {dest}: {counts}; recovery.json")
        return EXIT_OK
    finally:
        if tmp is not None and not keep_tmp:
            atomic.remove_tree(tmp)
        if not os.path.lexists(dest):
            made.prune()


@command("pipeline.archive")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=f"python -m {NAME}", description=__doc__.splitlines()[0])
    add = ap.add_argument
    source = "a run directory, a sweep directory or a checkpoint (or DEST with --check)"
    add("source", type=Path, help=source)
    add("dest", nargs="?", help="where the archive appears (must not exist)")
    add("overrides", nargs="*", help="hydra.searchpath=[...]: where your own configs are")
    add("--checkpoints", default="best,final,newest", help="best,final,newest (any of them) or all")
    add("--with-data", action="store_true", help="archive the corpus and the text files too")
    check = "re-verify an archive: python -m pipeline.archive --check DEST"
    add("--check", action="store_true", help=check)
    args = ap.parse_intermixed_args(argv)
    # a str: Path() eats pkg://
    extra = [*([args.dest] if args.check and args.dest else []), *args.overrides]
    if (bad := next((o for o in extra if not o.startswith("hydra.searchpath=")), None)) is not None:
        raise CommandError(f"{bad}: only hydra.searchpath=[...] can be given here")
    which = args.checkpoints
    if which != "all" and not set(which.split(",")) <= set(SELECTIONS):
        give = "give any of best,final,newest (comma-separated) or all"
        raise CommandError(f"--checkpoints={which}: {give}")
    try:
        if args.check:  # every file, link and checkpoint of a published archive, from its bytes
            if not (args.source / "MANIFEST.json").is_file():
                raise BadSource(f"{args.source}: not an archive (no MANIFEST.json)")
            if failed := _failed(checks_on(args.source, args.source, None, extra, False)["checks"]):
                print(f"{NAME}: {args.source}: {failed['detail']}", file=sys.stderr)
                return EXIT_ERROR
            return EXIT_OK
        if args.dest is None:
            raise BadSource("give SOURCE and DEST (or --check DEST)")
        dest = Path(os.path.abspath(args.dest))
        return build_archive(args.source, dest, which, args.with_data, args.overrides, argv)
    except ValueError as e:  # a value a file holds that is out of range: bad input
        raise CommandError(str(e)) from e
    except OSError as e:  # what SOURCE or DEST cannot give or take: bad input, nothing published
        if isinstance(e, atomic.UnsafePathError):
            raise
        raise CommandError(f"{e.filename or ''}: {e.strerror or e}") from e


if __name__ == "__main__":
    run_command(NAME, main, INTERRUPTED)
