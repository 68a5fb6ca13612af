"""An Optuna study continued by the same command (docs/tracking.md: Optuna sweeps resume too): `n_trials` counts
completed trials, a trial cut by a signal or failed is replaced, and a continued study asks for new trials."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_for_subprocess

# the preset at a tiny size: a trial is 6 steps, 2 train kill points each (12 points per trial)
OPTUNA = (
    "-m",
    "hparams_search=minigpt_optuna",
    "data=grammar_tiny",
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "tracking=none",
    "trainer.progress_bar=false",
    "hydra/job_logging=disabled",
)


def sweep(out: Path, *overrides: str, chaos: str | None = None) -> subprocess.CompletedProcess:
    env = env_for_subprocess()
    if chaos:
        env["PIPELINE_CHAOS"] = chaos
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *OPTUNA, *overrides, f"paths.output_dir={out}"],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
    )


def study(out: Path) -> list[tuple[str, dict]]:
    """(state, params) of every trial of the one study under `out`, in trial order, read by optuna itself."""
    import optuna

    (directory,) = (out / "sweeps").iterdir()
    trials = optuna.load_study(
        study_name=directory.name.rsplit("-", 1)[1], storage=f"sqlite:///{directory / 'optuna.db'}"
    ).get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(len(trials)))
    return [(t.state.name, t.params) for t in trials]


def records(out: Path) -> dict[int, str]:
    (directory,) = (out / "sweeps").iterdir()
    return {
        int(p.stem): json.loads(p.read_text())["status"]
        for p in (directory / "jobs").glob("*.json")
    }


@pytest.mark.slow
def test_a_signal_during_a_trial_fails_it_exits_75_and_the_same_command_completes_the_study(
    tmp_path,
):
    out = tmp_path / "out"
    cut = sweep(out, "hydra.sweeper.n_trials=3", chaos="train:17:TERM")  # trial 1's third step
    assert cut.returncode == 75, cut.stderr[-3000:]
    assert "Traceback" not in cut.stderr and "the sweep was interrupted" in cut.stderr
    # the cut trial is failed in the study (not left running), and no trial was asked for after it
    assert [state for state, _ in study(out)] == ["COMPLETE", "FAIL"]
    assert records(out) == {0: "complete", 1: "preempted"}
    again = sweep(out, "hydra.sweeper.n_trials=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [state for state, _ in study(out)] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert records(out) == {0: "complete", 1: "preempted", 2: "complete", 3: "complete"}
    done = sweep(
        out, "hydra.sweeper.n_trials=3"
    )  # complete: nothing asked, nothing to re-run, exit 0
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(study(out)) == 4


@pytest.mark.slow
def test_a_trial_killed_mid_run_is_not_counted_the_re_run_asks_for_the_missing_ones(tmp_path):
    out = tmp_path / "out"
    killed = sweep(out, "hydra.sweeper.n_trials=3", chaos="train:17")
    assert killed.returncode == -signal.SIGKILL
    assert [state for state, _ in study(out)] == ["COMPLETE", "RUNNING"]
    again = sweep(out, "hydra.sweeper.n_trials=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [state for state, _ in study(out)].count("COMPLETE") == 3


@pytest.mark.slow
def test_a_failed_trial_is_replaced_and_the_re_run_asks_only_for_the_missing_ones(tmp_path):
    out = tmp_path / "out"
    args = (
        "hydra.sweeper.n_trials=4",
        "optimizer.lr=choice(0.003,-1.0)",
    )  # a negative lr: that job is refused
    first = sweep(out, *args)
    assert first.returncode == 2, first.stderr[
        -3000:
    ]  # the failed job's code, after every trial ran
    assert "Traceback" not in first.stderr
    states = [state for state, _ in study(out)]
    assert (
        len(states) == 4 and "FAIL" in states and "COMPLETE" in states
    )  # the seed gives both kinds
    assert [p["optimizer.lr"] < 0 for _, p in study(out)] == [s == "FAIL" for s in states]
    again = sweep(out, *args)
    after = [state for state, _ in study(out)]
    assert len(after) == 4 + states.count("FAIL")  # one new trial for each one missing, numbered on
    assert sorted(records(out)) == list(range(len(after)))
    assert again.returncode == (0 if after.count("COMPLETE") == 4 else 2), again.stderr[-3000:]


@pytest.mark.slow
def test_a_study_whose_every_trial_failed_ends_with_its_table_and_their_code(tmp_path):
    """Optuna's sweeper then finds no best trial and raises: the jobs' failures are the sweep's end, not that."""
    out = tmp_path / "out"
    proc = sweep(out, "hydra.sweeper.n_trials=2", "optimizer.lr=choice(-1.0,-2.0)")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "pipeline: 2 of 2 jobs failed: job 0 " in proc.stderr
    assert [state for state, _ in study(out)] == ["FAIL", "FAIL"]


@pytest.mark.slow
def test_a_continued_study_asks_for_new_trials_the_same_ones_for_the_same_study(tmp_path):
    def continued(out: Path) -> list[dict]:
        for n in (2, 4):
            proc = sweep(out, f"hydra.sweeper.n_trials={n}", "trainer.max_steps=2")
            assert proc.returncode == 0, proc.stderr[-3000:]
        return [params for _, params in study(out)]

    trials = continued(tmp_path / "a")
    assert len(trials) == 4
    assert all(
        trials[i] != trials[j] for i in range(4) for j in range(i)
    )  # trial 2 is not trial 0 again
    assert continued(tmp_path / "b") == trials  # deterministic for a given study
