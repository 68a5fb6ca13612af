"""The run in its directory (pipeline/run/loop.py): one step-end decision, preemption seen by every stage, forks
that never keep another history's checkpoints, allowed changes that take effect, refusals that change nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import KERNODECK, kept, metrics, run_job, the_run

from pipeline.checkpoint.directory import EXTRA, WEIGHTS
from pipeline.checkpoint.store import CheckpointStore
from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.config.identity import lineage_of
from pipeline.files import jsonio
from pipeline.run.directory import RunDir
from pipeline.run.signals import SIGNALS_STATE


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file and link under root, by relative path (links by their target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = b"-> " + str(p.readlink()).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


# kernodeck over 5 epochs: an eval every 5 steps (best candidates), a periodic checkpoint every epoch (6 steps)
LONG = ("trainer.max_steps=30",)


@pytest.mark.parametrize("k", [3, 5, 10, 17, 25])
def test_preempted_then_resumed_keeps_exactly_the_uninterrupted_checkpoints(
    tmp_path, preempt_at, finished_job, k
):
    """Regression (#10.3): the preemption checkpoint goes through the stages' decision, so best-val sees it
    and rotation removes it: the same checkpoint directories, links and bytes as the run never stopped."""
    ref, out = finished_job(*KERNODECK, *LONG), tmp_path / "out"
    preempt_at(k)
    assert run_job(*KERNODECK, *LONG, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    stopped = RunDir(the_run(out))
    assert stopped.read_status()["status"] == "preempted" and stopped.read_status()["step"] == k
    assert k in dict(stopped.store.steps())  # the preemption checkpoint, kept as the newest
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*KERNODECK, *LONG, f"paths.output_dir={out}")[0] == 0
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))


def test_a_preempted_best_step_is_best(tmp_path, preempt_at):
    """Regression (#10.3): before, the step a SIGTERM stopped at was never offered to best-val."""
    out = tmp_path / "out"
    preempt_at(5)  # the first evaluation: necessarily the best so far
    assert run_job(*KERNODECK, *LONG, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    store = RunDir(the_run(out)).store
    assert store.link_step("best") == 5
    extra = jsonio.read(store.root / "step-00000005" / EXTRA, 1 << 20)
    assert extra["stages"]["best_val"]["best_step"] == 5


def test_a_fork_into_an_occupied_run_directory_keeps_nothing_of_the_other_history(
    tmp_path, finished_job
):
    """Regression (#10.1): resume.source into a run directory holding another history's step of the same
    number kept the old directory; now the other history is moved aside whole and the new one written. A fork has
    a directory of its own (#39.22): the other history is put there, as a clean run's directory held a fork once."""
    out = finished_job(*KERNODECK, *LONG, copy_to=tmp_path / "out")  # run A: lr 0.03
    args = (*KERNODECK, *LONG, f"paths.output_dir={out}")
    run_a = the_run(out)
    assert run_job(*args, "optimizer.lr=0.05")[0] == 0  # run B: lr 0.05, its own directory
    run_b = next(p for p in (out / "runs").iterdir() if p != run_a)
    source = RunDir(run_a).store.root / "step-00000018"
    fork = (
        *args,
        "optimizer.lr=0.05",
        f"resume.source={source}",
        "resume.allow_changes=[optimizer.lr]",
    )
    assert run_job(*fork)[0] == 0
    (run_f,) = [p for p in (out / "runs").iterdir() if p not in (run_a, run_b)]
    shutil.rmtree(run_f)
    shutil.copytree(run_b, run_f, symlinks=True)  # another history (run B's) where the fork goes
    old_b = kept(run_f)
    assert run_job(*fork)[0] == 0
    new_b = kept(run_f)
    assert new_b[1] == old_b[1]  # the same links ...
    for step in new_b[0]:  # ... to new checkpoints: none of the earlier lr=0.05 run's survives
        assert new_b[0][step][WEIGHTS] != old_b[0].get(step, {}).get(WEIGHTS)
    (moved,) = (run_f / "superseded").iterdir()  # the other history, whole, beside it
    assert kept(None, CheckpointStore(moved / "checkpoints")) == old_b
    assert (moved / "metrics.jsonl").is_file() and (moved / "run.json").is_file()
    manifest = jsonio.read(RunDir(run_f).store.root / "final" / "manifest.json", 1 << 24)
    assert manifest["lineage"]["origin"]["checkpoint"] == str(source)
    assert manifest["allowed_changes"] == {"optimizer.lr": [0.03, 0.05]}
    lines = metrics(run_f)
    assert [ln["step"] for ln in lines] == list(range(1, 31))
    assert lines[:18] == metrics(run_a)[:18]  # the history before the cut is the source run's


def test_a_fork_never_takes_a_clean_runs_directory(tmp_path, finished_job):
    """#39.22: a fork with an allowed change (6 steps at lr 0.03, then 4 at 0.05) was written to the directory a clean
    lr=0.05 run is named by, so the clean run's command (and a sweep's job) found it complete as its own. Now the
    fork's directory is named by its history: the clean run after it starts fresh in its own, with its own results,
    those of the same clean run in another output directory (the oracle)."""
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")  # run A: lr 0.03
    run_a = the_run(out)
    args = (*KERNODECK, f"paths.output_dir={out}", "optimizer.lr=0.05")
    fork = (
        *args,
        f"resume.source={RunDir(run_a).store.root / 'step-00000006'}",
        "resume.allow_changes=[optimizer.lr]",
    )
    assert run_job(*fork)[0] == 0
    (run_f,) = [p for p in (out / "runs").iterdir() if p != run_a]
    assert run_job(*args)[0] == 0  # the clean lr=0.05 run
    (run_c,) = [p for p in (out / "runs").iterdir() if p not in (run_a, run_f)]
    assert run_f.name.split("-")[0] == run_c.name.split("-")[0] == "kernodeck"
    clean = finished_job(*KERNODECK, "optimizer.lr=0.05")
    assert run_c.name == the_run(clean).name  # a plain run's name as before
    assert RunDir(run_c).read_status()["resumes"] == [] and not (run_c / "superseded").exists()
    assert metrics(run_c) == metrics(the_run(clean)) != metrics(run_f)
    assert kept(run_c) == kept(the_run(clean))
    assert (
        run_job(*fork)[0] == 0 and [p.name for p in (out / "runs").iterdir()].count(run_f.name) == 1
    )
    assert kept(run_f)[0][10][WEIGHTS] != kept(run_c)[0][10][WEIGHTS]


def test_a_fork_written_in_a_clean_runs_directory_is_not_that_clean_run(tmp_path, finished_job):
    """#39.22: a fork made before forks had directories of their own lies where the clean run's is: the clean
    command starts fresh (the fork moved whole to superseded/) instead of taking the fork as its complete self."""
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    run_a = the_run(out)
    args = (*KERNODECK, f"paths.output_dir={out}", "optimizer.lr=0.05")
    assert (
        run_job(
            *args,
            f"resume.source={RunDir(run_a).store.root / 'step-00000006'}",
            "resume.allow_changes=[optimizer.lr]",
        )[0]
        == 0
    )
    (run_f,) = [p for p in (out / "runs").iterdir() if p != run_a]
    clean = the_run(finished_job(*KERNODECK, "optimizer.lr=0.05"))
    old_fork = kept(run_f)
    run_f.rename(out / "runs" / clean.name)  # where the fork was written before
    assert run_job(*args)[0] == 0
    run_c = out / "runs" / clean.name
    assert metrics(run_c) == metrics(clean) and kept(run_c) == kept(clean)
    (moved,) = (run_c / "superseded").iterdir()
    assert kept(None, CheckpointStore(moved / "checkpoints")) == old_fork


def test_a_fork_whose_source_was_replaced_is_refused(tmp_path, finished_job):
    """#39.4: the fork's lineage holds its source's weights: with A's step 6 replaced by another run's step 6, the
    identical fork command is a fork of other weights, refused (that run's seed differs), never its complete self."""
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")  # run A
    other = finished_job(*KERNODECK, "trainer.seed=7")
    run_a = the_run(out)
    source = RunDir(run_a).store.root / "step-00000006"
    fork = (
        *KERNODECK,
        f"paths.output_dir={out}",
        "optimizer.lr=0.05",
        f"resume.source={source}",
        "resume.allow_changes=[optimizer.lr]",
    )
    assert run_job(*fork)[0] == 0
    shutil.rmtree(source)
    shutil.copytree(RunDir(the_run(other)).store.root / "step-00000006", source)
    before = tree_bytes(out)
    assert run_job(*fork)[0] == 2
    assert {k: v for k, v in tree_bytes(out).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


def test_an_allowed_change_takes_effect_from_the_cut(tmp_path, finished_job):
    """Regression (#10.2): an allowed optimizer.lr change came back from the checkpoint's optimizer and
    scheduler state, so the old lr went on; now the scheduler's base lr is the config's."""
    out = finished_job(*KERNODECK, *LONG, copy_to=tmp_path / "out")
    args = (*KERNODECK, *LONG, f"paths.output_dir={out}")
    run_a = the_run(out)
    source = RunDir(run_a).store.root / "step-00000018"
    assert (
        run_job(
            *args,
            "optimizer.lr=0.05",
            f"resume.source={source}",
            "resume.allow_changes=[optimizer.lr]",
        )[0]
        == 0
    )
    run_b = next(p for p in (out / "runs").iterdir() if p != run_a)
    lr = {ln["step"]: ln["lr"] for ln in metrics(run_b)}
    # StepLR(step_size=3, gamma=0.5): update k (0-based) uses base_lr * 0.5 ** (k // 3)
    assert [lr[s] for s in range(19, 31)] == [0.05 * 0.5 ** ((s - 1) // 3) for s in range(19, 31)]
    assert [lr[s] for s in range(1, 19)] == [0.03 * 0.5 ** ((s - 1) // 3) for s in range(1, 19)]
    assert kept(run_b)[0][30][WEIGHTS] != kept(run_a)[0][30][WEIGHTS]


def test_an_allowed_change_that_cannot_apply_is_refused_and_nothing_changes(tmp_path, finished_job):
    out = finished_job(*KERNODECK, *LONG, copy_to=tmp_path / "out")
    args = (*KERNODECK, *LONG, f"paths.output_dir={out}")
    run_a = the_run(out)
    source = RunDir(run_a).store.root / "step-00000018"
    before = tree_bytes(out)
    code, _ = run_job(
        *args, "trainer.seed=7", f"resume.source={source}", "resume.allow_changes=[trainer.seed]"
    )
    assert code == 2
    after = tree_bytes(out)
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


def test_drift_is_refused_naming_each_key_and_changes_nothing(tmp_path, capsys, finished_job):
    out = finished_job(*KERNODECK, *LONG, copy_to=tmp_path / "out")
    args = (*KERNODECK, *LONG, f"paths.output_dir={out}")
    source = RunDir(the_run(out)).store.root / "step-00000018"
    before = tree_bytes(out)
    code, _ = run_job(*args, "optimizer.lr=0.05", "model.dropout=0.1", f"resume.source={source}")
    assert code == 2
    err = capsys.readouterr().err
    assert "optimizer.lr: 0.03 -> 0.05" in err and "model.dropout: 0.25 -> 0.1" in err
    assert "resume.allow_changes=[" in err and len(err.strip().splitlines()) == 1
    assert {k: v for k, v in tree_bytes(out).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


def test_rerunning_a_fork_continues_it_rather_than_starting_it_again(
    tmp_path, preempt_at, finished_job
):
    """The identical resume.source command after a preemption continues the fork (safe to re-run)."""
    out = finished_job(*KERNODECK, *LONG, copy_to=tmp_path / "out")
    args = (*KERNODECK, *LONG, f"paths.output_dir={out}")
    run_a = the_run(out)
    fork = (
        *args,
        "optimizer.lr=0.05",
        f"resume.source={RunDir(run_a).store.root / 'step-00000018'}",
        "resume.allow_changes=[optimizer.lr]",
    )
    preempt_at(22)
    assert run_job(*fork)[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*fork)[0] == 0
    run_b = next(p for p in (out / "runs").iterdir() if p != run_a)
    assert not (run_b / "superseded").exists()  # its own history was continued, not moved aside
    assert [ln["step"] for ln in metrics(run_b)] == list(range(1, 31))
    assert run_job(*fork)[0] == 0  # complete: nothing to do
    assert RunDir(run_b).read_status()["status"] == "complete"


def test_a_changed_hyperparameter_on_a_finished_run_says_how_to_continue_it(
    tmp_path, caplog, finished_job
):
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    with caplog.at_level("INFO", logger="pipeline"):
        assert (
            run_job(
                *KERNODECK, f"paths.output_dir={out}", "optimizer.lr=0.05", "trainer.max_steps=12"
            )[0]
            == 0
        )
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "differs from the finished run" in said and "optimizer.lr 0.03 -> 0.05" in said
    source, keys = re.search(
        r"use resume\.source=(\S+) resume\.allow_changes=\[([^]]*)]", said
    ).groups()
    assert keys == "optimizer.lr,trainer.max_steps"
    assert (
        run_job(
            *KERNODECK,
            f"paths.output_dir={out}",
            "optimizer.lr=0.05",
            "trainer.max_steps=12",
            f"resume.source={source}",
            f"resume.allow_changes=[{keys}]",
        )[0]
        == 0
    )  # the hint's command trains on
    caplog.clear()
    with caplog.at_level(
        "INFO", logger="pipeline"
    ):  # the same steps: a fork of its end would train nothing
        assert run_job(*KERNODECK, f"paths.output_dir={out}", "optimizer.lr=0.05")[0] == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "differs from the finished run" in said and "resume.source=" not in said


def test_the_hint_for_a_sibling_with_other_data_is_a_command_that_continues_it(
    tmp_path, caplog, preempt_at
):
    """One drift for the refusal and the hint: a change of the data's config shows with the data it makes (its
    key covers the data's hash), and the command the hint gives is accepted."""
    out = tmp_path / "out"
    args = (*KERNODECK, f"paths.output_dir={out}")
    preempt_at(5)
    assert run_job(*args)[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    run_a = the_run(out)
    with caplog.at_level("INFO", logger="pipeline"):
        assert run_job(*args, "data.noise=0.1")[0] == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert (
        f"differs from the interrupted run {run_a.name} in data.noise 0.05 -> 0.1; data_manifest_hash"
        in said
    )
    source, keys = re.search(
        r"use resume\.source=(\S+) resume\.allow_changes=\[([^]]*)]", said
    ).groups()
    assert (source, keys) == (str(RunDir(run_a).store.root / "step-00000005"), "data.noise")
    before = set((out / "runs").iterdir())
    assert (
        run_job(
            *args, "data.noise=0.1", f"resume.source={source}", f"resume.allow_changes=[{keys}]"
        )[0]
        == 0
    )
    (run_b,) = set((out / "runs").iterdir()) - before  # a fork's own directory
    manifest = jsonio.read(RunDir(run_b).store.root / "final" / "manifest.json", 1 << 24)
    assert manifest["lineage"]["origin"]["checkpoint"] == source and manifest["step"] == 10
    assert set(manifest["allowed_changes"]) == {"data.noise", "data_manifest_hash"}


@pytest.mark.parametrize("damage", ["a stray file in its checkpoints/", "its newest manifest"])
def test_a_sibling_whose_checkpoints_do_not_read_is_passed_over(tmp_path, caplog, damage):
    out = tmp_path / "out"
    args = (*KERNODECK, f"paths.output_dir={out}")
    assert run_job(*args)[0] == 0
    store = RunDir(the_run(out)).store
    if damage == "its newest manifest":
        (store.steps()[-1][1] / "manifest.json").write_text("{")
    else:
        (store.root / "notes.txt").write_text("mine")
    with caplog.at_level("INFO", logger="pipeline"):
        assert run_job(*args, "optimizer.lr=0.05")[0] == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "starting a new run" in said and "differs from the" not in said


def test_resume_and_training_are_no_stages_and_cannot_be_removed(tmp_path, capsys):
    """~stages.resume and ~stages.train are refused in one line, exit 2, before anything is made."""
    out = tmp_path / "out"
    for key in ("resume", "train"):
        assert run_job(*KERNODECK, f"paths.output_dir={out}", f"~stages.{key}") == (2, None)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"pipeline: stages.{key} is missing (~stages."
        )
        assert "is not a stage and cannot be removed" in err
        assert not out.exists()


def test_stages_resume_source_never_starts_from_scratch_in_the_same_directory(tmp_path):
    """stages.resume.source=never (what ~stages.resume did): a fresh history each time in the run's directory,
    the earlier one moved to superseded/."""
    out = tmp_path / "out"
    args = (*KERNODECK, f"paths.output_dir={out}", "stages.resume.source=never")
    assert run_job(*args)[0] == 0
    first = kept(the_run(out))
    assert run_job(*args)[0] == 0
    assert [ln["step"] for ln in metrics(the_run(out))] == list(range(1, 11))
    assert kept(the_run(out)) == first  # the same history again, from scratch
    assert len(list((the_run(out) / "superseded").iterdir())) == 1
    manifest = jsonio.read(RunDir(the_run(out)).store.root / "final" / "manifest.json", 1 << 24)
    assert manifest["lineage"] == lineage_of(manifest["semantic_config_hash"], None)


def test_the_manifest_and_run_json_are_standard_json(finished_job):
    out = finished_job(*KERNODECK)
    for p in the_run(out).rglob("*.json*"):
        for text in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
            json.loads(text, parse_constant=lambda c, p=p: pytest.fail(f"{p}: bare {c}"))


def test_auto_resume_falls_back_past_a_checkpoint_whose_state_does_not_fit(
    tmp_path, preempt_at, finished_job
):
    """Regression (#12): a stage state of the wrong type (hashes intact) passed inspect and crashed the resume,
    which only fell back past CheckpointErrors; now it is a CheckpointError like any other damage."""
    import hashlib

    from pipeline.run.signals import SIGNALS_STATE

    ref, out = finished_job(*KERNODECK, *LONG), tmp_path / "out"
    preempt_at(20)
    assert run_job(*KERNODECK, *LONG, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    newest = RunDir(the_run(out)).store.steps()[-1][1]
    extra = json.loads((newest / EXTRA).read_text())
    extra["stages"]["best_val"]["best_step"] = "twenty"
    (newest / EXTRA).write_text(json.dumps(extra))
    m = json.loads((newest / "manifest.json").read_text())
    data = (newest / EXTRA).read_bytes()
    m["files"][EXTRA] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / "manifest.json").write_text(json.dumps(m))
    assert run_job(*KERNODECK, *LONG, f"paths.output_dir={out}")[0] == 0
    assert kept(the_run(out)) == kept(the_run(ref))


def test_a_lock_held_for_milliseconds_waits_a_held_one_is_busy(tmp_path, monkeypatch):
    """The tracking agent links run.json under the run's lock for milliseconds: a job arriving then waits for
    it (rundir.LOCK_GRACE) instead of calling the directory busy; a lock held longer is busy, in one line."""
    import fcntl
    import threading

    from pipeline.run import directory as rd

    first = RunDir(tmp_path / "run")
    first.acquire()  # creates the directory and the lock file
    first.release()
    other = os.open(tmp_path / "run" / ".lock", os.O_RDWR)
    fcntl.flock(
        other, fcntl.LOCK_EX | fcntl.LOCK_NB
    )  # another open file description: another holder
    threading.Timer(0.3, lambda: fcntl.flock(other, fcntl.LOCK_UN)).start()
    mine = RunDir(tmp_path / "run")
    mine.acquire()  # waited for the short holder
    mine.release()
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    monkeypatch.setattr(rd, "LOCK_GRACE", 0.2)
    with pytest.raises(rd.RunBusyError, match="in use by another process"):
        RunDir(tmp_path / "run").acquire()
    os.close(other)


def test_a_fork_with_nothing_left_to_train_is_refused(tmp_path, capsys, finished_job):
    """#39.11: debug=fdr (trainer.max_steps=1) forked from step 6 wrote run.json `complete at step 6 of 1` and no
    checkpoint; so did a fork of a finished run's end. A plain re-run of a finished run says complete and changes
    nothing, its checkpoints its own; a fork that would train nothing is refused in one line, nothing written."""
    out = finished_job(*KERNODECK, copy_to=tmp_path / "out")
    args = (*KERNODECK, f"paths.output_dir={out}")
    store = RunDir(the_run(out)).store
    before = {k: v for k, v in tree_bytes(out).items() if not k.endswith(".lock")}
    for fork in [
        (
            "debug=fdr",
            f"resume.source={store.root / 'step-00000006'}",
            "resume.allow_changes=[trainer.max_steps]",
        ),
        (f"resume.source={store.root / 'final'}",),
        (
            "optimizer.lr=0.05",
            f"resume.source={store.root / 'final'}",
            "resume.allow_changes=[optimizer.lr]",
        ),
    ]:
        assert run_job(*args, *fork)[0] == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "refusing to resume from" in err and "train" in err, (
            err
        )
        assert {k: v for k, v in tree_bytes(out).items() if not k.endswith(".lock")} == before
    assert run_job(*args)[0] == 0  # the finished run itself: complete, as it was
    assert {k: v for k, v in tree_bytes(out).items() if not k.endswith(".lock")} == before
    assert (
        run_job(
            *args,
            "trainer.max_steps=12",
            f"resume.source={store.root / 'final'}",
            "resume.allow_changes=[trainer.max_steps]",
        )[0]
        == 0
    )  # more steps: a fork that trains


def test_a_preempted_run_of_resume_never_says_what_continues_it(
    tmp_path, capsys, caplog, preempt_at, finished_job
):
    """#39.10: debug=limit (resume=never) stopped by SIGTERM said `re-run the same command to resume`, and that
    command started a new run from step 0. What it says now follows from the resume setting: the identical command
    starts anew (as it does), and the command it gives continues this run to the uninterrupted run's end."""
    out = tmp_path / "out"
    args = (*KERNODECK, "debug=limit", f"paths.output_dir={out}")
    preempt_at(3)
    with caplog.at_level("INFO", logger="pipeline"):
        assert run_job(*args)[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    stopped = the_run(out)
    err = capsys.readouterr().err
    assert "re-run the same command" not in err + caplog.text
    (source,) = re.findall(
        r"starts a new run \(resume=never\); add resume\.source=(\S+) to continue this one", err
    )
    assert source == str(RunDir(stopped).store.root / "step-00000003")
    (again,) = [
        ln for ln in caplog.text.splitlines() if ln.strip().startswith("resume ")
    ]  # the end summary's
    assert again.endswith(f"debug=limit paths.output_dir={out} resume.source={source}")
    assert run_job(*args)[0] == 0  # the identical command: a new run from step 0, as said
    (new,) = [p for p in (out / "runs").iterdir() if p != stopped]
    assert metrics(new)[0]["step"] == 1 and RunDir(new).read_status()["resumes"] == []
    assert (
        run_job(*args, f"resume.source={source}")[0] == 0
    )  # the command it gave: this run, continued
    (continued,) = [p for p in (out / "runs").iterdir() if p not in (stopped, new)]
    ref = the_run(finished_job(*KERNODECK, "debug=limit"))
    assert metrics(continued) == metrics(ref)
    assert kept(continued)[0][4][WEIGHTS] == kept(ref)[0][4][WEIGHTS]
