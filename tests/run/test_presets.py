"""The presets in conf/debug/ and conf/hparams_search/, each run and held to what its header line says."""

from __future__ import annotations

import json
import math
import sqlite3

import pytest
from conftest import KERNODECK, PROJECT_ROOT, kept, metrics, run_job, run_pipeline, the_run

from pipeline.run.directory import RunDir
from pipeline.trainer.phases import PHASES, Profile

CONFIG_DIR = PROJECT_ROOT / "conf"


def lines(run) -> list[dict]:
    return RunDir(run).read_metrics()


def evaluated(run) -> list[int]:
    return [ln["step"] for ln in lines(run) if "val/loss" in ln]


@pytest.mark.parametrize(
    "group, option",
    [
        (p.parent.name, p.stem)
        for p in sorted(
            [
                *(CONFIG_DIR / "debug").glob("*.yaml"),
                *(CONFIG_DIR / "hparams_search").glob("*.yaml"),
            ]
        )
    ],
)
def test_every_preset_says_what_it_does_in_its_header(group, option):
    header = (CONFIG_DIR / group / f"{option}.yaml").read_text().splitlines()
    assert header[0] == "# @package _global_" and header[1].startswith("# ") and len(header[1]) > 40


def test_fdr_is_one_update_one_evaluation_then_stop(tmp_path):
    out = tmp_path / "out"
    assert run_job(*KERNODECK, "debug=fdr", f"paths.output_dir={out}")[0] == 0
    run = the_run(out)
    assert [ln["step"] for ln in lines(run)] == [1] and evaluated(run) == [1]
    assert [s for s, _ in RunDir(run).store.steps()] == [1]
    assert RunDir(run).read_status()["status"] == "complete" and not (out / "mlflow.db").exists()


def test_limit_is_a_few_batches_of_each(tmp_path):
    out = tmp_path / "out"
    assert run_job(*KERNODECK, "debug=limit", f"paths.output_dir={out}")[0] == 0
    run = the_run(out)
    assert [ln["step"] for ln in lines(run)] == [1, 2, 3, 4] and evaluated(run) == [2, 4]
    assert [s for s, _ in RunDir(run).store.steps()] == [2, 4]


@pytest.mark.slow  # 300 updates of the default MiniGPT on a tiny corpus
def test_overfit_drives_the_train_loss_far_below_its_start_and_the_val_loss(tmp_path):
    out = tmp_path / "out"
    assert run_job("debug=overfit", "trainer.progress_bar=false", f"paths.output_dir={out}")[0] == 0
    got = lines(the_run(out))
    assert len(got) == 300 // 50 and got[-1]["step"] == 300
    assert (
        got[-1]["train/loss"] < 0.2 * got[0]["train/loss"]
        and got[-1]["train/loss"] < 0.5 * got[-1]["val/loss"]
    )


def profile_rows(text: str) -> dict[str, tuple[int, float]]:
    table = text[text.index("profile (trainer.profile=true):") :].splitlines()[2:]
    rows = {}
    for line in table[: len(PHASES) + 1]:
        name, rest = line[:20].strip(), line[20:].split()
        rows[name] = (int(rest[0]) if len(rest) == 3 else 0, float(rest[-2]))
    return rows


def test_profile_prints_every_phase_summing_to_the_wall_and_changes_no_result_byte(
    tmp_path, capsys
):
    args = (*KERNODECK, "trainer.accumulate=2", "trainer.eval_every=4")
    assert run_job(*args, f"paths.output_dir={tmp_path / 'plain'}")[0] == 0
    assert "profile (trainer.profile=true)" not in capsys.readouterr().out
    assert run_job(*args, "debug=profile", f"paths.output_dir={tmp_path / 'timed'}")[0] == 0
    rows = profile_rows(capsys.readouterr().out)
    assert list(rows) == [*PHASES, "wall"]
    assert rows["data"][0] == 20  # 10 updates of 2 micro-batches ...
    assert (
        rows["forward/backward"][0] == 30
    )  # ... each one forward/backward, and each update's mean of the two
    assert rows["optimizer"][0] == 10 and rows["evaluation"][0] == 3  # steps 4, 8 and the last
    best, improved = math.inf, set()
    for step, loss in (
        (ln["step"], ln["val/loss"])
        for ln in lines(the_run(tmp_path / "timed"))
        if "val/loss" in ln
    ):
        if loss < best:
            best, improved = loss, improved | {step}
    assert rows["checkpoint"][0] == len(
        {3, 6, 9, 10} | improved
    )  # epochs' ends (3 updates), the last, the bests
    parts = sum(seconds for name, (_, seconds) in rows.items() if name != "wall")
    assert parts == pytest.approx(rows["wall"][1], rel=1e-3, abs=2e-4)  # the table's 4 decimals
    plain, timed = the_run(tmp_path / "plain"), the_run(tmp_path / "timed")
    assert plain.name == timed.name  # not part of the run's identity
    assert kept(plain) == kept(timed) and metrics(plain) == metrics(timed)


def test_profile_off_times_nothing():
    off = Profile(False)
    with off.phase("data"):
        pass
    assert off.phase("data") is off.phase("checkpoint") and set(off.calls.values()) == {0}


@pytest.mark.slow  # an Optuna study of 3 trials of the default model, shrunk
def test_hparams_search_runs_its_trials_over_the_named_space(tmp_path):
    out = tmp_path / "out"
    proc = run_pipeline(
        [
            "-m",
            "hparams_search=minigpt_optuna",
            "hydra.sweeper.n_trials=3",
            "tracking=none",
            "trainer.max_steps=3",
            "data.n_sentences=200",
            "data.block_size=16",
            "trainer.progress_bar=false",
            f"paths.output_dir={out}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (out / "sweeps").iterdir()
    jobs = [json.loads(p.read_text()) for p in sorted((sweep / "jobs").glob("*.json"))]
    assert len(jobs) == 3 and all(
        j["status"] == "complete" and math.isfinite(j["objective"]) for j in jobs
    )
    for job in jobs:
        swept = dict(o.split("=", 1) for o in job["overrides"][:3])
        assert set(swept) == {"optimizer.lr", "model.n_embd", "model.n_layer"}, job["overrides"]
        assert 1e-4 <= float(swept["optimizer.lr"]) <= 1e-2
        assert swept["model.n_embd"] in ("32", "64", "128") and swept["model.n_layer"] in (
            "1",
            "2",
            "3",
        )
    with sqlite3.connect(sweep / "optuna.db") as db:
        assert db.execute("select count(*) from trials where state = 'COMPLETE'").fetchone() == (3,)
        names = {n for (n,) in db.execute("select distinct param_name from trial_params")}
    assert names == {"optimizer.lr", "model.n_embd", "model.n_layer"}
    assert "best/val/loss (min)" in proc.stderr + proc.stdout
