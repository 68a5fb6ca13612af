"""pipeline.archive: an archive recovers the run from its destination alone (evaluate, sample, a resume to the
uninterrupted run's bytes), appears whole or not at all under SIGKILL, detects a flipped byte, refuses an
existing DEST and every bad SOURCE in one line, and never changes SOURCE."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    KERNODECK,
    PROJECT_ROOT,
    TINY,
    env_for_subprocess,
    refused_in_one_line,
    run_pipeline,
    the_run,
    tree,
)

pytestmark = pytest.mark.slow
MOONS = (
    "hydra.searchpath=[pkg://moons.conf]",
    "experiment=moons",
    "tracking=none",
    "trainer.progress_bar=false",
    "trainer.max_steps=12",
    "trainer.eval_every=4",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=4",
)
EXAMPLE = PROJECT_ROOT / "examples" / "moons"


def archive(*args, cwd: Path) -> subprocess.CompletedProcess:
    return run_pipeline([str(a) for a in args], cwd, module="pipeline.archive")


def train(overrides, out: Path, cwd: Path) -> Path:
    proc = run_pipeline([*overrides, f"paths.output_dir={out}"], cwd)
    assert proc.returncode == 0, proc.stderr
    return the_run(out)


def recover_from_dest_alone(tmp_path, overrides, searchpath=(), sample=False):
    """Train, archive every checkpoint, delete the whole original output directory (run and corpus), then from
    DEST alone: inspect, evaluate (its val/loss equals the run's), sample, and a resume from the earliest
    archived checkpoint to the end whose final weights bytes equal the uninterrupted run's."""
    cwd, out, dest = tmp_path / "cwd", tmp_path / "out", tmp_path / "dest"
    run = train(overrides, out, cwd)
    reference = (run / "checkpoints" / "final" / "weights.safetensors").read_bytes()
    before = tree(out)
    proc = archive(run, dest, "--checkpoints", "all", *searchpath, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert tree(out) == before  # SOURCE untouched, byte for byte, mode and mtime
    report = json.loads((dest / "recovery.json").read_text())
    assert report["all_checks_passed"] and all(c["passed"] for c in report["checks"])
    (proof,) = report["resume"]
    assert proof["passed"] and proof["step_recovered"] < proof["to_step"]
    assert (
        all(proof["compared"]["final_files_equal"].values()) and proof["compared"]["metrics_equal"]
    )
    shutil.rmtree(out)  # the machine goes away: only DEST is left

    archived = dest / "runs" / run.name
    assert os.readlink(archived / "checkpoints" / "final").startswith("step-")
    inspect = run_pipeline([str(archived), *searchpath], cwd, module="pipeline.show")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    scratch = tmp_path / "scratch"
    best = archived / "checkpoints" / "best"
    ev = run_pipeline(
        [str(best), f"paths.output_dir={scratch}", *searchpath, "--json"],
        cwd,
        module="pipeline.evaluate",
    )
    assert ev.returncode == 0, ev.stderr
    manifest = json.loads((best / "manifest.json").read_text())
    assert json.loads(ev.stdout)["metrics"]["val/loss"] == manifest["metrics"]["val/loss"]
    if sample:
        s = run_pipeline(
            [
                str(archived / "checkpoints" / "final"),
                "prompt=the",
                "max_new_tokens=5",
                f"paths.output_dir={scratch}",
            ],
            cwd,
            module="pipeline.sample",
        )
        assert s.returncode == 0 and s.stdout.strip(), s.stderr
    earliest = sorted(p for p in (archived / "checkpoints").iterdir() if not p.is_symlink())[0]
    kept = list(overrides)
    resumed = run_pipeline(
        [*kept, f"resume.source={earliest}", f"paths.output_dir={tmp_path / 'resumed'}"], cwd
    )
    assert resumed.returncode == 0, resumed.stderr
    final = the_run(tmp_path / "resumed") / "checkpoints" / "final" / "weights.safetensors"
    assert final.read_bytes() == reference
    check = archive("--check", dest, *searchpath, cwd=cwd)  # nothing above wrote into DEST
    assert check.returncode == 0, check.stdout + check.stderr


def test_grammar_run_recovers_from_its_archive_alone(tmp_path):
    recover_from_dest_alone(tmp_path, TINY, sample=True)


def test_kernodeck_run_recovers_from_its_archive_alone(tmp_path):
    recover_from_dest_alone(
        tmp_path, (*KERNODECK, "checkpoint=every_n_steps", "checkpoint.every_steps=5")
    )


def test_own_model_recovers_from_its_archive_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    recover_from_dest_alone(tmp_path, MOONS, searchpath=("hydra.searchpath=[pkg://moons.conf]",))


@pytest.fixture
def finished(tmp_path) -> Path:
    return train(TINY, tmp_path / "out", tmp_path / "cwd")


def test_a_flipped_byte_in_the_archive_is_named(tmp_path, finished):
    dest = tmp_path / "dest"
    assert archive(finished, dest, cwd=tmp_path).returncode == 0
    assert archive("--check", dest, cwd=tmp_path).returncode == 0
    victim = dest / "runs" / finished.name / "checkpoints" / "final" / "weights.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    proc = archive("--check", dest, cwd=tmp_path)
    assert proc.returncode == 1
    assert "weights.safetensors" in proc.stderr and "sha256" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "planted, first",
    [
        ("runs/NOTES.txt", "runs/NOTES.txt"),
        ("runs/junk/", "runs/junk"),
        ("runs/junk/NOTES.txt", "runs/junk"),
        ("NOTES.txt", "NOTES.txt"),
    ],
)
def test_anything_planted_in_the_archive_is_named_as_not_listed(tmp_path, finished, planted, first):
    """A file or a directory, empty or not, that MANIFEST.json does not list: exit 1 naming the first (topmost)
    such entry, before anything in the archive is read as a run (a file where a run would be is not one)."""
    dest = tmp_path / "dest"
    assert archive(finished, dest, cwd=tmp_path).returncode == 0
    target = dest / planted
    target.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir() if planted.endswith("/") else target.write_text("mine\n")
    proc = archive("--check", dest, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        proc.stderr
        == f"pipeline.archive: {dest}: {first}: present but not listed in MANIFEST.json\n"
    ), proc.stderr


def test_an_existing_dest_and_bad_sources_are_refused_in_one_line(tmp_path, finished):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine").write_text("keep")
    assert "already exists" in refused_in_one_line(
        [str(finished), str(dest)], tmp_path, module="pipeline.archive"
    )
    assert (dest / "mine").read_text() == "keep" and os.listdir(dest) == ["mine"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "FIFO" in refused_in_one_line(
        [str(fifo), str(tmp_path / "d1")], tmp_path, module="pipeline.archive"
    )
    assert "not a run" in refused_in_one_line(
        [str(tmp_path / "cwd"), str(tmp_path / "d2")], tmp_path, module="pipeline.archive"
    )
    before = tree(finished, mtimes="none")
    extra = finished / "checkpoints" / "extra"
    os.symlink("/etc", extra)  # a link out of the run
    assert "symlink" in refused_in_one_line(
        [str(finished), str(tmp_path / "d3")], tmp_path, module="pipeline.archive"
    )
    extra.unlink()
    step = sorted((finished / "checkpoints").glob("step-*"))[-1]
    weights = step / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    line = refused_in_one_line(
        [str(finished), str(tmp_path / "d4")], tmp_path, module="pipeline.archive"
    )
    assert "weights.safetensors" in line
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert tree(finished, mtimes="none") == before
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith((".tmp-d", "d1", "d2", "d3", "d4"))
    ]


def test_dests_missing_parents_are_made_and_gone_again_when_nothing_is_published(
    tmp_path, finished
):
    assert "not a run" in refused_in_one_line(
        [str(tmp_path / "cwd"), str(tmp_path / "x" / "y" / "d")],
        tmp_path,
        module="pipeline.archive",
    )
    assert not (tmp_path / "x").exists()  # refused: the parents it made are removed again
    (tmp_path / "file").write_text("keep")
    assert "cannot be made for DEST" in refused_in_one_line(
        [str(finished), str(tmp_path / "file" / "d")], tmp_path, module="pipeline.archive"
    )
    assert (tmp_path / "file").read_text() == "keep"
    dest = tmp_path / "deep" / "er" / "dest"  # as `mkdir -p` would
    assert archive(finished, dest, cwd=tmp_path).returncode == 0
    assert archive("--check", dest, cwd=tmp_path).returncode == 0


def test_with_data_needs_the_corpus_of_data_that_keeps_one_and_archives_data_that_keeps_none(
    tmp_path, finished
):
    out = finished.parent.parent
    (out / "data").rename(out / "moved")  # the grammar run's corpus is no longer beside it
    line = refused_in_one_line(
        [str(finished), str(tmp_path / "dest"), "--with-data"], tmp_path, module="pipeline.archive"
    )
    assert "its corpus (MANIFEST.json sha256" in line and "--with-data needs it there" in line, line
    assert not (tmp_path / "dest").exists()
    rows = train(
        KERNODECK, tmp_path / "rows", tmp_path / "cwd"
    )  # regression data: generated, no corpus on disk
    proc = archive(rows, tmp_path / "dest", "--with-data", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "dest" / "recovery.json").read_text())["all_checks_passed"]


def test_text_data_needs_with_data_and_then_resumes_from_the_archived_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    overrides = (*TINY, "data=text", f"data.path={text}")
    overrides = tuple(o for o in overrides if not o.startswith("data.n_sentences"))
    run = train(overrides, tmp_path / "out", tmp_path / "cwd")
    line = refused_in_one_line(
        [str(run), str(tmp_path / "dest")], tmp_path, module="pipeline.archive"
    )
    assert "--with-data" in line and not (tmp_path / "dest").exists()
    proc = archive(run, tmp_path / "dest", "--with-data", "--checkpoints", "all", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "dest" / "recovery.json").read_text())
    assert report["all_checks_passed"] and "data.path=" in report["resume"][0]["command"]
    assert next(iter((tmp_path / "dest" / "sources").iterdir())).read_bytes() == text.read_bytes()


def test_sigkill_during_an_archive_never_leaves_a_dest_that_passes_as_complete(tmp_path, finished):
    before = tree(finished.parent.parent)
    t0 = time.monotonic()
    assert archive(finished, tmp_path / "timed", cwd=tmp_path).returncode == 0
    duration = time.monotonic() - t0
    rng = random.Random(22)
    outcomes = []
    scratch = (
        tmp_path / "tmp"
    )  # where a killed archiver's scratch resume directory is left (TMPDIR)
    scratch.mkdir()
    for i in range(20):
        dest = tmp_path / f"dest-{i}"
        p = subprocess.Popen(
            [sys.executable, "-m", "pipeline.archive", str(finished), str(dest)],
            cwd=tmp_path,
            env={**env_for_subprocess(), "TMPDIR": str(scratch)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(rng.uniform(0, duration))
        os.killpg(p.pid, signal.SIGKILL)  # the archiver and its resume process
        p.wait()
        if os.path.lexists(dest):
            check = archive("--check", dest, cwd=tmp_path)
            assert check.returncode == 0, check.stdout + check.stderr
            assert json.loads((dest / "recovery.json").read_text())["all_checks_passed"]
            outcomes.append("complete")
        else:
            outcomes.append("absent")
        assert tree(finished.parent.parent) == before
    assert "absent" in outcomes  # some kills landed mid-archive
    # a scratch resume directory, or the empty file Python's tempfile creates and removes to probe TMPDIR at its
    # first use (a kill between the two leaves it): nothing else
    left = sorted(
        p.name
        for p in scratch.iterdir()
        if not (re.fullmatch(r"[a-z0-9_]{8}", p.name) and p.is_file() and p.stat().st_size == 0)
    )
    assert all(name.startswith("pipeline-archive-resume-") for name in left), left
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-dest-")]
    if (
        stale
    ):  # a killed archive's temporary is ignored, and named by the next archive to the same DEST
        name = stale[0].name[len(".tmp-") :].rsplit("-", 1)[0]
        proc = archive(finished, tmp_path / name, cwd=tmp_path)
        assert proc.returncode == 0 and str(stale[0]) in proc.stderr, proc.stderr


def test_a_sweep_is_archived_job_by_job_with_its_records(tmp_path):
    out = tmp_path / "out"
    proc = run_pipeline(
        ["-m", *KERNODECK, "optimizer.lr=0.01,0.02", f"paths.output_dir={out}"], tmp_path / "cwd"
    )
    assert proc.returncode == 0, proc.stderr
    (sweep,) = (out / "sweeps").iterdir()
    runs = sorted(p.name for p in (out / "runs").iterdir())
    dest = tmp_path / "dest"
    proc = archive(sweep, dest, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (dest / "runs").iterdir()) == runs and len(runs) == 2
    report = json.loads((dest / "recovery.json").read_text())
    assert report["all_checks_passed"] and [p["passed"] for p in report["resume"]] == [True, True]
    # by default: best, final, and the newest checkpoint a resume continues from (before a finished run's final)
    assert all(p["step_recovered"] < p["to_step"] for p in report["resume"])
    assert (dest / "sweeps" / sweep.name / "sweep.json").read_bytes() == (
        sweep / "sweep.json"
    ).read_bytes()
    assert sorted(os.listdir(dest / "sweeps" / sweep.name / "jobs")) == ["0.json", "1.json"]


def test_a_killed_run_is_proven_on_the_steps_it_logged_after_its_newest_checkpoint(tmp_path):
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    env = {
        **env_for_subprocess(),
        "PIPELINE_CHAOS": "train:16",
    }  # SIGKILL inside update 8: newest checkpoint 6
    killed = subprocess.run(
        [sys.executable, "-m", "pipeline", *TINY, f"paths.output_dir={out}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = the_run(out)
    proc = archive(run, tmp_path / "dest", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (proof,) = json.loads((tmp_path / "dest" / "recovery.json").read_text())["resume"]
    assert proof["passed"] and proof["step_recovered"] == 6 and proof["to_step"] == 7
    assert proof["compared"] == {"metrics_lines_after_step": 1, "metrics_equal": True}


def test_a_checkpoint_alone_is_archived_with_its_run_files_or_restored_only(tmp_path, finished):
    proc = archive(finished / "checkpoints" / "best", tmp_path / "one", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    archived = tmp_path / "one" / "runs" / finished.name
    assert os.readlink(archived / "checkpoints" / "best") == os.readlink(
        finished / "checkpoints" / "best"
    )
    assert (archived / "metrics.jsonl").read_bytes() == (finished / "metrics.jsonl").read_bytes()
    loose = tmp_path / "loose" / "step-00000012"
    shutil.copytree(finished / "checkpoints" / "step-00000012", loose)
    proc = archive(loose, tmp_path / "two", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "two" / "recovery.json").read_text())
    assert report["all_checks_passed"] and report["resume"][0]["passed"] is None
    assert [c["check"] for c in report["checks"]][-1].startswith("restore runs/")


@pytest.mark.parametrize(
    "name",
    ["../../ESCAPED", "/ABSOLUTE", "a\nb", "n" * 300],
    ids=["parent", "absolute", "newline", "300-chars"],
)
def test_a_lone_checkpoint_naming_a_path_is_refused_and_nothing_lands_outside_dest(
    tmp_path, finished, name
):
    """A checkpoint alone is archived under runs/<its config's name>-<hash>/: a manifest whose config.name is a
    path (its config_hash and semantic_config_hash recomputed, as whoever edits it would) is refused in one line
    naming the manifest and the value, before DEST's temporary is made; nothing appears anywhere."""
    from pipeline.config.identity import config_hash, semantic_hash

    loose = tmp_path / "loose" / "step-00000012"
    shutil.copytree(finished / "checkpoints" / "step-00000012", loose)
    m = json.loads((loose / "manifest.json").read_text())
    m["config"]["name"] = name if name != "/ABSOLUTE" else str(tmp_path / "ABSOLUTE")
    m["config_hash"], m["semantic_config_hash"] = (
        config_hash(m["config"]),
        semantic_hash(m["config"], m["sources"]),
    )
    (loose / "manifest.json").write_text(json.dumps(m))
    dest = tmp_path / "x" / "y" / "dest"
    dest.parent.mkdir(parents=True)
    cwd = tmp_path / "cwd"  # the finished run's working directory
    before = tree(tmp_path)
    line = refused_in_one_line([str(loose), str(dest)], cwd, module="pipeline.archive")
    assert (
        line.startswith("pipeline.archive: ") and f"{loose}: its manifest's config.name=" in line
    ), line
    assert repr(m["config"]["name"])[:20] in line, line
    assert tree(tmp_path) == before  # no DEST, no temporary, nothing escaped beside it or above it


def test_archive_builds_only_single_names_inside_its_root(tmp_path):
    from pipeline.cli.archive import Builder
    from pipeline.files.atomic import UnsafePathError
    from pipeline.files.names import BadName

    root = tmp_path / "root"
    root.mkdir()
    b = Builder(root)
    for rel in ("runs/../../escaped/f", "../f", "/abs/f", "runs//f"):
        with pytest.raises(UnsafePathError):
            b.write(rel, b"x")
    for rel in ("runs/..", "runs/a\nb", "runs/" + "n" * 300):
        with pytest.raises(BadName):
            b.write(rel, b"x")
    with pytest.raises(BadName):
        b.link("runs/..", "x")
    assert os.listdir(tmp_path) == ["root"] and os.listdir(root) in ([], ["runs"])


@pytest.mark.parametrize("model", [{"n_layer": 1, "n_head": 2, "n_embd": 16}, {"hidden": [8]}])
def test_the_readme_names_sample_and_export_hf_for_a_model_of_gpt2_shape_only(tmp_path, model):
    """A capability of the model's config (export_hf.gpt2_shaped), not its class's name: any class of that shape."""
    from pipeline.cli.archive import readme
    from pipeline.cli.export_hf import gpt2_shaped

    run = {
        "checkpoints": {"step-00000004": {"step": 4, "tags": [], "links": ["final"]}},
        "data": {"data_manifest_hash": "0" * 64, "corpus": None, "sources": {}},
        "with_data": False,
        "resume_overrides": [],
        "model": "mine.AnyName",
        "generates": gpt2_shaped(model),
    }
    text = readme(tmp_path / "dest", {"runs": {"r": run}})
    shaped = "n_layer" in model
    assert ("python -m pipeline.sample" in text) == shaped
    assert ("python -m pipeline.export_hf" in text) == shaped
