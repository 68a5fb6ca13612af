"""A config-only change never costs a run its history: over a catalogue of changes, each on an interrupted and
on a complete run, the re-run is refused with every file as it was, or it continues (or starts its own run),
and every earlier checkpoint and metrics.jsonl line is still in the run directory or under its superseded/."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, kept, metrics, run_job, sigterm_during, the_run, tree

# kernodeck: 6 updates an epoch, a rotating checkpoint every epoch, best-val at every evaluation (every 4)
BASE = (*KERNODECK, "trainer.max_steps=40", "trainer.eval_every=4")
CUT = 20  # the interrupted run's last checkpoint
KILLED_AFTER = 23  # ... and what it logged before it was killed (SIGKILL: no checkpoint of these)

# name: (overrides, the same math as the base run: its final weights must be the uninterrupted run's)
CHANGES = {
    "nothing": ((), True),
    "early_stop added": (("+stages/early_stop=default",), False),
    "early_stop added, patience 1": (
        ("+stages/early_stop=default", "stages.early_stop.patience=1"),
        False,
    ),
    "best_val removed": (("~stages.best_val",), True),
    "rotate removed": (("~stages.rotate_last_3",), True),
    "final removed": (("~stages.final",), True),
    "rotate keep 1": (("stages.rotate_last_3.keep=1",), True),
    "best_val monitor": (("stages.best_val.monitor=train/loss",), True),
    "best_val mode": (("stages.best_val.mode=max",), True),
    "best_val keep 3": (("stages.best_val.keep=3",), True),
    "best_val keep 3, named": (
        ("stages.best_val.keep=3", "stages.best_val.filename='{step}-{val_loss:.3f}'"),
        True,
    ),
    "a bad filename": (("stages.best_val.filename='../{step}'",), False),
    "cadence": (("checkpoint=every_n_steps", "checkpoint.every_steps=2"), True),
    "threads": (("trainer.threads=1",), True),
    "log_every": (("trainer.log_every=5",), True),
    "max_steps": (("trainer.max_steps=50",), False),
    "lr": (("optimizer.lr=0.05",), False),
    "lr allowed": (("optimizer.lr=0.05", "resume.allow_changes=[optimizer.lr]"), False),
    "a bad value": (("stages.rotate_last_3.keep=0",), False),
    "a monitor never logged": (("stages.best_val.monitor=val/los",), False),
    "an early stop on a monitor never logged": (
        ("+stages/early_stop=default", "stages.early_stop.monitor=val/los"),
        False,
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The base run, uninterrupted."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert run_job(*BASE, f"paths.output_dir={out}")[0] == 0
    return the_run(out)


def stopped_at(step: int, *overrides: str, out: Path) -> None:
    """The base run (with `overrides`) in `out`, stopped by a SIGTERM during update `step`: its checkpoint written."""
    with sigterm_during(step):
        assert run_job(*BASE, *overrides, f"paths.output_dir={out}")[0] == 75


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> Path:
    """The base run stopped at CUT by a SIGTERM: its checkpoint written, no metrics line past it."""
    out = tmp_path_factory.mktemp("preempted") / "out"
    stopped_at(CUT, out=out)
    return out


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, reference, preempted) -> Path:
    """The preempted run, then what a process killed at KILLED_AFTER had logged past it: metrics.jsonl ahead of
    the newest checkpoint."""
    out = shutil.copytree(preempted, tmp_path_factory.mktemp("interrupted") / "out", symlinks=True)
    run = the_run(out)
    later = [
        ln
        for ln in (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
        if CUT < int(ln.split('"step":')[1].split(",")[0].split("}")[0]) <= KILLED_AFTER
    ]
    assert later
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(later)
    return out


@pytest.fixture(scope="module")
def complete(reference) -> Path:
    return reference.parent.parent


def weights_everywhere(run: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("weights.safetensors")}


def lines_everywhere(run: Path) -> set[str]:
    files = [run / "metrics.jsonl", *run.glob("superseded/*/metrics.jsonl")]
    return {ln for f in files if f.exists() for ln in f.read_text().splitlines()}


@pytest.mark.slow
@pytest.mark.parametrize("state", ["interrupted", "complete"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_config_only_change_keeps_every_earlier_checkpoint_and_metrics_line(
    change, state, request, tmp_path, reference, capsys, caplog
):
    caplog.set_level(logging.INFO, logger="pipeline")
    out = shutil.copytree(request.getfixturevalue(state), tmp_path / "out", symlinks=True)
    run = the_run(out)
    before = tree(run)
    weights, lines = weights_everywhere(run), lines_everywhere(run)
    overrides, same_math = CHANGES[change]
    capsys.readouterr()
    code, _ = run_job(*BASE, *overrides, f"paths.output_dir={out}")
    said = capsys.readouterr()
    if code != 0:
        assert code == 2 and len(said.err.strip().splitlines()) == 1, (
            said.err
        )  # refused in one line ...
        assert tree(run) == before  # ... with every file as it was
        return
    if (
        change == "nothing"
    ):  # the identical command: the run that never stopped, its rotation included
        assert kept(run) == kept(reference)
        assert metrics(run) == metrics(reference)
        return
    assert weights <= weights_everywhere(run), "an earlier checkpoint is gone"
    assert lines <= lines_everywhere(run), "an earlier metrics.jsonl line is gone"
    others = [p for p in (out / "runs").iterdir() if p != run]
    if others:  # a changed hyperparameter: its own run, this one untouched
        assert tree(run) == before
        return
    if state == "complete":
        assert (
            tree(run) == before
        )  # a finished run re-run with any change is confirmed, nothing written
        assert f"run {run} is complete" in said.out
        return
    assert f"resuming from step {CUT}" in caplog.text
    if same_math:  # the resumed run is the run that never stopped
        last = f"checkpoints/step-{40:08d}/weights.safetensors"
        assert (run / last).read_bytes() == (reference / last).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, said",
    [
        (
            "stages.best_val.monitor=train/loss",
            "monitor 'val/loss' mode 'min' -> 'train/loss' mode 'min'",
        ),
        (
            "stages.best_val.mode=max",
            "monitor 'val/loss' mode 'min' -> 'val/loss' mode 'max'",
        ),  # step 12 ranks first
    ],
)
def test_a_new_monitor_starts_a_new_best_history_and_keeps_the_old_best(
    change, said, interrupted, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="pipeline")
    out = shutil.copytree(interrupted, tmp_path / "out", symlinks=True)
    run = the_run(out)
    old_best = (run / "checkpoints" / "best").resolve()
    old_bytes = (old_best / "weights.safetensors").read_bytes()
    assert run_job(*BASE, change, f"paths.output_dir={out}")[0] == 0
    assert f"stages.best_val: {said}: a new history" in caplog.text
    (kept,) = run.glob("superseded/*/checkpoints")
    assert (
        kept / "best" / "weights.safetensors"
    ).read_bytes() == old_bytes  # the earlier best, by its link
    from pipeline.files import jsonio

    extra = jsonio.read(run / "checkpoints" / "final" / "extra.json", 1 << 20)
    assert (
        extra["stages"]["best_val"]["best_step"] > CUT
    )  # a new best history, from the resume on ...
    assert extra["stages"]["best_val"]["since"] == CUT
    best = int((run / "checkpoints" / "best").resolve().name.split("-")[1])
    assert (
        best == extra["stages"]["best_val"]["best_step"]
    )  # ... and the link follows it, not an older step


@pytest.mark.slow
def test_a_stage_added_to_a_run_in_progress_counts_from_the_resume(interrupted, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline")
    out = shutil.copytree(interrupted, tmp_path / "out", symlinks=True)
    run = the_run(out)
    assert (
        run_job(
            *BASE,
            "+stages/early_stop=default",
            "stages.early_stop.patience=1",
            "stages.early_stop.min_delta=0.01",
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    assert "stages.early_stop: not in the checkpoint, starts fresh here" in caplog.text
    from pipeline.files import jsonio

    status = jsonio.read(run / "run.json", 1 << 20)
    assert status["status"] == "complete" and status["ended"].startswith("early_stop")
    # fresh at the resume: its first evaluation after CUT (24) is its best, the next (28), not better by 0.01,
    # ends the run
    assert status["step"] == 28


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_moved_aside_not_deleted(interrupted, tmp_path, caplog):
    out = shutil.copytree(interrupted, tmp_path / "out", symlinks=True)
    run = the_run(out)
    newest = run / "checkpoints" / f"step-{CUT:08d}"
    data = bytearray((newest / "weights.safetensors").read_bytes())
    data[-3] ^= 0x10
    (newest / "weights.safetensors").write_bytes(bytes(data))
    assert run_job(*BASE, f"paths.output_dir={out}")[0] == 0
    assert (
        "not resuming from a damaged checkpoint (kept in superseded/, nothing is deleted), falling back: "
        f"checkpoint {newest}: weights.safetensors: sha256 differs"
    ) in caplog.text
    (moved,) = run.glob(f"superseded/*/checkpoints/{newest.name}")
    assert (moved / "weights.safetensors").read_bytes() == bytes(
        data
    )  # as it was found, damage and all


@pytest.mark.slow
def test_a_fresh_start_in_a_directory_with_a_history_moves_it_aside(interrupted, tmp_path):
    out = shutil.copytree(interrupted, tmp_path / "out", symlinks=True)
    run = the_run(out)
    for step_dir in (run / "checkpoints").glob("step-*"):  # no checkpoint it can use
        (step_dir / "manifest.json").write_text("{}")
    weights, lines = weights_everywhere(run), lines_everywhere(run)
    assert run_job(*BASE, f"paths.output_dir={out}")[0] == 0
    assert weights <= weights_everywhere(run) and lines <= lines_everywhere(run)
    (moved,) = run.glob("superseded/*")
    assert (moved / "run.json").is_file() and (moved / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_a_run_trained_by_other_code_says_so_when_resumed_found_complete_and_shown(
    interrupted, complete, tmp_path, caplog, capsys
):
    from pipeline.cli import show
    from pipeline.files import jsonio

    caplog.set_level(logging.INFO, logger="pipeline")
    for state, source in (("interrupted", interrupted), ("complete", complete)):
        out = shutil.copytree(source, tmp_path / state, symlinks=True)
        run = the_run(out)
        for manifest in (run / "checkpoints").glob(
            "step-*/manifest.json"
        ):  # listed nowhere: edited freely
            m = jsonio.read(manifest, 1 << 24)
            m["code_sha256"] = "0" * 64
            manifest.write_bytes(jsonio.dumps(m))
        capsys.readouterr()
        show.main([str(run)])
        assert "trained by other code than this: commit" in capsys.readouterr().out
        caplog.clear()
        assert run_job(*BASE, f"paths.output_dir={out}")[0] == 0
        assert "was trained by other code than this: commit" in caplog.text, state
        assert "(code sha256 000000000000), now commit" in caplog.text


# --- every way into a run directory keeps what it finds ------------------------------------------------------
FORKED_AT = 21  # a fork of the preempted run's step 18, itself stopped here (its step 20, a best, before it)


@pytest.fixture(scope="module")
def fork_source(tmp_path_factory, preempted) -> Path:
    """A step of another run to fork from (a copy: forking reads it, nothing may write it)."""
    out = shutil.copytree(preempted, tmp_path_factory.mktemp("source") / "out", symlinks=True)
    return the_run(out) / "checkpoints" / f"step-{18:08d}"


@pytest.fixture(scope="module")
def forked(tmp_path_factory, preempted, fork_source) -> Path:
    """The preempted run's output directory with a fork of `fork_source` beside it (a fork is a run directory of its
    own, named by its lineage), stopped at FORKED_AT."""
    out = shutil.copytree(preempted, tmp_path_factory.mktemp("forked") / "out", symlinks=True)
    stopped_at(FORKED_AT, f"resume.source={fork_source}", out=out)
    return out


def step_dirs(out: Path) -> dict[tuple, Path]:
    """Every step directory under `out` (an output directory's run directories: their checkpoints/ and
    superseded/), links not followed, by its content: the sorted (name, sha256) of its files."""
    found = {}
    for dirpath, dirnames, _ in os.walk(out):
        for name in dirnames:
            d = Path(dirpath) / name
            if re.fullmatch(r"step-\d{8}", name) and not d.is_symlink():
                found[
                    tuple(
                        sorted(
                            (f.name, hashlib.sha256(f.read_bytes()).hexdigest())
                            for f in d.iterdir()
                            if f.is_file() and not f.is_symlink()
                        )
                    )
                ] = d
    return found


def all_lines(out: Path) -> set[str]:
    return {ln for run in (out / "runs").iterdir() for ln in lines_everywhere(run)}


def damage(step_dir: Path) -> Path:
    weights = step_dir / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    return step_dir


def recode(run: Path) -> None:
    """Every checkpoint's manifest says another version of the code made it (code_sha256 is listed nowhere)."""
    from pipeline.files import jsonio

    for manifest in (run / "checkpoints").glob("step-*/manifest.json"):
        m = jsonio.read(manifest, 1 << 24)
        m["code_sha256"] = "0" * 64
        manifest.write_bytes(jsonio.dumps(m))


# name: (the directory entered, its change before the command (given its run, returns the steps it damaged),
# the command's own overrides (fork: resume.source of `fork_source`), whether the run goes on with the lineage
# it found, so that its own retention may prune that lineage's verified steps as the uninterrupted run would)
WAYS = {
    "fresh": (
        "interrupted",
        lambda run: [
            p.joinpath("manifest.json").write_text("{}") and p
            for p in (run / "checkpoints").glob("step-*")
        ],
        (),
        False,
    ),
    "continue": ("interrupted", lambda run: [], (), True),
    "complete": ("complete", lambda run: [], (), False),
    "fork": ("preempted", lambda run: [], ("fork",), False),
    "fork again": ("forked", lambda run: [], ("fork",), True),
    "fork again past a damaged step": (
        "forked",
        lambda run: [damage(run / "checkpoints" / f"step-{FORKED_AT:08d}")],
        ("fork",),
        True,
    ),
    "fallback past a damaged step": (
        "interrupted",
        lambda run: [damage(run / "checkpoints" / f"step-{CUT:08d}")],
        (),
        True,
    ),
    "re-tune only": ("preempted", lambda run: [], ("stages.rotate_last_3.keep=1",), False),
    "other code": ("interrupted", lambda run: recode(run) or [], (), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_every_way_into_a_run_directory_keeps_every_step_directory_and_metrics_line(
    way, request, tmp_path, caplog, fork_source
):
    """Whatever a start, resume, fork or fallback finds (every step directory, every metrics.jsonl line) is after
    it still in a run directory or under its superseded/; only the run's own retention, going on with the
    lineage it found under the same policies, prunes that lineage's verified checkpoints (as the run that never
    stopped did)."""
    from pipeline.files import jsonio

    caplog.set_level(logging.INFO, logger="pipeline")
    entered, change, overrides, goes_on = WAYS[way]
    out = shutil.copytree(request.getfixturevalue(entered), tmp_path / "out", symlinks=True)
    clean = {p.name for p in (request.getfixturevalue("preempted") / "runs").iterdir()}
    run = next(
        p for p in (out / "runs").iterdir() if entered != "forked" or p.name not in clean
    )  # the fork's own
    damaged = {p.resolve() for p in change(run) if p}
    before, lines = step_dirs(out), all_lines(out)
    lineages = {
        k: jsonio.loads(d.joinpath("manifest.json").read_bytes()).get("lineage", {}).get("id")
        for k, d in before.items()
    }
    assert damaged <= {p.resolve() for p in before.values()}
    if way.startswith("fork again"):  # the fork's own older step: what a re-run continues from
        assert len(list((run / "checkpoints").glob("step-*"))) >= 2
    fork = (f"resume.source={fork_source}",) if "fork" in overrides else ()
    assert (
        run_job(*BASE, *fork, *(o for o in overrides if o != "fork"), f"paths.output_dir={out}")[0]
        == 0
    )
    after = step_dirs(out)
    assert lines <= all_lines(out), "an earlier metrics.jsonl line is gone"
    lost = [before[k] for k in before.keys() - after.keys()]
    for d in damaged:  # passed over, kept as found, and said so
        assert d not in [p.resolve() for p in lost], f"{d.name}, damaged, is gone"
        assert (
            f"not resuming from a damaged checkpoint (kept in superseded/, nothing is deleted), falling back: "
            f"checkpoint {run / 'checkpoints' / d.name}" in caplog.text
        )
    if not goes_on:
        assert not lost, f"gone: {lost}"
        return
    live = jsonio.read(run / "checkpoints" / "final" / "manifest.json", 1 << 24)["lineage"]["id"]
    for k in before.keys() - after.keys():  # the lineage the run went on with, its own retention
        assert lineages[k] == live, f"{before[k]}, of another lineage, is gone"


def other_filesystem(tmp_path: Path) -> Path:
    """A new directory on another filesystem than tmp_path (/dev/shm), which a mount namespace can bind; else skip."""
    import subprocess
    import tempfile

    if (
        not shutil.which("unshare")
        or not os.path.isdir("/dev/shm")
        or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev
    ):
        pytest.skip("needs unshare and /dev/shm on another filesystem than the test's tmp_path")
    if subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    ).returncode:
        pytest.skip("needs a mount namespace (unshare --mount: root, or user namespaces)")
    return Path(tempfile.mkdtemp(dir="/dev/shm", prefix="pipeline-test-"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "mounted, way",
    [
        ("superseded", "fallback past a damaged step"),
        ("superseded", "fresh"),
        ("checkpoints", "fallback past a damaged step"),
        ("checkpoints", "fresh"),
    ],
)
def test_a_history_moved_to_another_filesystem_is_copied_whole_before_its_original_goes(
    mounted, way, interrupted, tmp_path
):
    """The run directory's superseded/ (or its checkpoints/) is a bind mount of another filesystem: a rename
    cannot cross it (EXDEV; EBUSY for a mount point), so what moves aside is copied whole, then removed."""
    import subprocess

    from conftest import env_for_subprocess

    other = other_filesystem(tmp_path)
    try:
        out = shutil.copytree(interrupted, tmp_path / "out", symlinks=True)
        run = the_run(out)
        damaged = {p.resolve() for p in WAYS[way][1](run) if p}
        before, lines = step_dirs(out), all_lines(out)
        links = {p.name: os.readlink(p) for p in (run / "checkpoints").iterdir() if p.is_symlink()}
        if (
            mounted == "checkpoints"
        ):  # its content moves to the other filesystem, mounted back in its place
            shutil.copytree(run / "checkpoints", other / "checkpoints", symlinks=True)
            shutil.rmtree(run / "checkpoints")
            (run / "checkpoints").mkdir()
            source = other / "checkpoints"
        else:
            (run / "superseded").mkdir()
            source = other
        script = 'mount --bind "$1" "$2"; shift 2; exec "$@"'
        proc = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-ec",
                script,
                "sh",
                str(source),
                str(run / mounted),
                sys.executable,
                "-m",
                "pipeline",
                *BASE,
                f"paths.output_dir={out}",
            ],
            cwd=tmp_path,
            env=env_for_subprocess(),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert (
            all_lines(out)
            | {ln for f in other.rglob("metrics.jsonl") for ln in f.read_text().splitlines()}
            >= lines
        ), "an earlier metrics.jsonl line is gone"
        live = step_dirs(other / "checkpoints" if mounted == "checkpoints" else run / "checkpoints")
        aside = step_dirs(other if mounted == "superseded" else run / "superseded")
        moved = [k for k, d in before.items() if way == "fresh" or d.resolve() in damaged]
        assert moved and all(
            k in aside and k not in live for k in moved
        )  # copied whole, the original gone
        if way == "fresh":  # the store moved whole: its links too
            (store,) = (other if mounted == "superseded" else run / "superseded").glob(
                "*/checkpoints"
            )
            assert (
                {p.name: os.readlink(p) for p in store.iterdir() if p.is_symlink()} == links != {}
            )
    finally:
        shutil.rmtree(other, ignore_errors=True)
