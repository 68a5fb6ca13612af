"""What a run says: the start block's parameter count (tied arrays once), throughput, the curve's data, and the
end summary's commands, run as printed."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from pipeline.model.base import summary
from pipeline.run.directory import RunDir
from pipeline.run.job import build
from pipeline.run.report import end_block, start_block, tool_args
from pipeline.run.signals import SIGNALS_STATE
from pipeline.trainer import curves
from pipeline.trainer.display import Throughput
from tests.conftest import (
    KERNODECK,
    PROJECT_ROOT,
    SHARED_SERVER,
    TINY,
    config_of,
    env_for_subprocess,
    pasted,
    run_job,
    run_pipeline,
    the_run,
    wait_until,
)


def _unique_size(model) -> int:
    """The oracle: every distinct array object of the state dict (aliases included) once."""
    return sum(a.size for a in {id(a): a for a in model.state_dict().values()}.values())


@pytest.mark.parametrize("overrides", [TINY, KERNODECK], ids=["minigpt", "mlp"])
def test_the_start_block_counts_each_array_once(tmp_path, overrides):
    job = build(config_of(*overrides, f"paths.output_dir={tmp_path}"))
    model = job.state.model
    rows, total = summary(model.params, model.aliases)
    assert total == _unique_size(model) == sum(p.size for p in model.params.values())
    assert sum(r[2] for r in rows) == total
    block = start_block(job, tmp_path / "run")
    assert f"{total:,} parameters" in block.splitlines()[0]
    if model.aliases:  # MiniGPT: lm_head is wte, said, never counted twice
        assert "tied" in block and len(model.state_dict()) > len(model.params)
        assert ("lm_head", [], 0, "lm_head.weight tied to transformer.wte.weight") in rows
        assert {r[0] for r in rows} >= {
            "transformer.wte",
            "transformer.wpe",
            "transformer.h.0",
            "transformer.ln_f",
        }
        assert "vocab" in block and f"{job.state.dataset.n_train:,} train windows" in block
    else:  # the MLP's layers
        assert [r[0] for r in rows] == ["layers.0", "layers.1"] and [r[2] for r in rows] == [
            2 * 8 + 8,
            8 + 1,
        ]
        assert "24 train rows" in block


def test_summary_groups_a_stack_by_its_index_and_notes_a_tie():
    w = np.zeros((5, 3))
    params = {
        "emb.weight": w,
        "h.0.a.weight": np.zeros(4),
        "h.0.b.bias": np.zeros(2),
        "h.1.a.weight": np.zeros(7),
    }
    rows, total = summary(params, {"head.weight": "emb.weight"})
    assert total == 15 + 4 + 2 + 7
    assert [(r[0], r[2]) for r in rows] == [("emb", 15), ("h.0", 6), ("h.1", 7), ("head", 0)]
    assert rows[-1][3] == "head.weight tied to emb.weight"


def test_throughput_is_the_recent_window_not_the_whole_run():
    t = Throughput(per_update=64, unit="tokens", window=4)
    t.step(0.0)  # the start
    assert t.rates() is None
    for now in (10.0, 20.0, 20.5, 21.0, 21.5, 22.0):  # two slow updates, then 2 per second
        t.step(now)
    steps, tokens = t.rates()
    assert steps == pytest.approx(2.0) and tokens == pytest.approx(128.0)
    assert t.text() == "2 steps/s 128 tokens/s"


def test_the_curve_plots_every_line_it_is_given():
    lines = [{"step": s, "epoch": 0, "train/loss": 1.0 / s, "lr": 0.1} for s in range(1, 11)]
    lines += [
        {"step": 5, "val/loss": 0.3},
        {"step": 10, "val/loss": 0.2, "lr": True},  # a bool is not a number
        {"step": 11, "train/loss": float("nan"), "val/loss": float("inf")},
    ]  # nor a non-finite one
    assert curves.series(lines, "train/loss")[0] == list(range(1, 11))
    assert curves.series(lines, "val/loss") == ([5, 10], [0.3, 0.2])
    assert curves.series(lines, "lr")[0] == list(range(1, 11))
    png = curves.draw(lines)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert curves.draw([]) is None


def _summary_of(stdout: str) -> dict[str, str]:
    """The end summary's `  key   value` lines after the `complete at step` line."""
    lines = stdout.splitlines()
    start = max(
        i
        for i, ln in enumerate(lines)
        if re.search(r"\] - (complete|preempted|failed) at step", ln)
    )
    out = {}
    for ln in lines[start + 1 :]:
        m = re.match(
            r"  (best|checkpoints|curve|mlflow ui|mlflow|resume|evaluate|sample|then open) +(.*)$",
            ln,
        )
        if not m:
            break
        out[m[1]] = m[2]
    return out


@pytest.mark.slow
def test_the_end_summary_says_where_things_are_and_its_commands_work(tmp_path):
    out = tmp_path / "out"
    args = [*TINY, f"paths.output_dir={out}", "trainer.max_steps=8"]
    proc = run_pipeline(args, tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr
    run = the_run(out)
    said = _summary_of(proc.stdout)
    assert len(said) <= 11
    assert said["curve"] == str(run / "curves.png") and (run / "curves.png").stat().st_size > 0
    assert said["mlflow"] == "not tracked" and "mlflow ui" not in said
    assert re.fullmatch(r"val/loss=\S+ at step 8", said["best"])
    assert (
        said["checkpoints"] == f"{run / 'checkpoints'}/: final=step-00000008 best=step-00000008 "
        "newest=step-00000008"
    )
    for key in ("resume", "evaluate", "sample"):  # as printed, from another directory
        done = pasted(said[key], tmp_path)
        assert done.returncode == 0, (key, said[key], done.stderr)
    assert "is complete at step 8" in pasted(said["resume"], tmp_path).stdout
    assert "pipeline.evaluate" in said["evaluate"] and said["evaluate"].endswith(
        str(run / "checkpoints/best")
    )


def test_a_resumed_runs_curve_covers_every_step(tmp_path, monkeypatch, preempt_at):
    args = [*KERNODECK, f"paths.output_dir={tmp_path / 'out'}"]
    drawn = []
    real = curves.draw
    monkeypatch.setattr(curves, "draw", lambda lines: drawn.append(lines) or real(lines))
    preempt_at(4)
    assert run_job(*args)[0] == 75
    run = the_run(tmp_path / "out")
    assert curves.series(drawn[-1], "train/loss")[0] == [1, 2, 3, 4]  # preempted: drawn too
    assert (run / "curves.png").stat().st_size > 0
    preempt_at(None)
    SIGNALS_STATE.received = None
    assert run_job(*args)[0] == 0
    assert curves.series(drawn[-1], "train/loss")[0] == list(
        range(1, 11)
    )  # the whole history, not this process's
    assert curves.series(drawn[-1], "val/loss")[0] == [5, 10]
    assert (run / "curves.png").read_bytes() == real(drawn[-1])


@pytest.mark.slow
def test_a_sweep_jobs_time_is_its_own(tmp_path):
    """Two jobs in one process: the second's "after N s in this job" is no more than the wall time between
    the first's last line and its own (the process's age would add the first job and the imports)."""
    from datetime import datetime

    proc = run_pipeline(
        # 300 updates: a job's time is printed to 0.1 s, and 10 of kernodeck's can take less than 0.05 s
        [
            "-m",
            *KERNODECK,
            "trainer.seed=1,2",
            "trainer.max_steps=300",
            f"paths.output_dir={tmp_path / 'out'}",
        ],
        tmp_path / "cwd",
    )
    assert proc.returncode == 0, proc.stderr
    done = [
        (datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), float(m[2]))
        for m in re.finditer(
            r"^\[([\d :,-]+)\]\[pipeline\]\[INFO\] - done at step 300 \(max_steps\) after ([\d.]+) s "
            r"in this job",
            proc.stdout,
            re.M,
        )
    ]
    assert len(done) == 2, proc.stdout
    (first_end, _), (second_end, second_took) = done
    assert 0 < second_took <= second_end - first_end + 0.05  # 0.05: the line rounds to 0.1 s


def test_a_failed_run_with_checkpoints_ends_with_its_summary_and_curve(
    tmp_path, monkeypatch, caplog
):
    import pipeline.trainer.loop as loop

    real = loop.train_step

    def step(state):  # a NaN loss at update 5: failed (exit 1), the checkpoints of 2 and 4 kept
        record = real(state)
        if state.step == 5:
            record["train/loss"] = float("nan")
        return record

    monkeypatch.setattr(loop, "train_step", step)
    caplog.set_level("INFO", logger="pipeline")
    assert (
        run_job(
            *KERNODECK,
            f"paths.output_dir={tmp_path / 'out'}",
            "checkpoint=every_n_steps",
            "checkpoint.every_steps=2",
        )[0]
        == 1
    )
    run = the_run(tmp_path / "out")
    (said,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("failed at step 5: ")
    ]
    assert f"curve       {run / 'curves.png'}" in said and (run / "curves.png").stat().st_size > 0
    assert "newest=step-00000004" in said and "mlflow      not tracked" in said
    assert "evaluate    " in said and "sample" not in said  # an MLP: no text to sample


def test_a_complete_run_killed_before_its_curve_gets_it_on_the_next_command(tmp_path):
    args = [*KERNODECK, f"paths.output_dir={tmp_path / 'out'}"]
    assert run_job(*args)[0] == 0
    png = the_run(tmp_path / "out") / "curves.png"
    drawn = png.read_bytes()
    png.unlink()  # as a kill between the final checkpoint and the curve leaves it
    assert run_job(*args)[0] == 0
    assert png.read_bytes() == drawn


MOONS = PROJECT_ROOT / "examples" / "moons"


def _pasted(said: dict[str, str], cwd, env) -> dict[str, subprocess.CompletedProcess]:
    """Each command of the end summary, run as printed, pasted into a shell in the run's working directory."""
    return {
        key: pasted(said[key], cwd, env) for key in ("resume", "evaluate", "sample") if key in said
    }


@pytest.mark.slow
@pytest.mark.parametrize("how", ["searchpath", "config-dir"])
def test_the_end_summary_commands_of_a_run_of_your_own_configs_work_pasted(
    tmp_path, monkeypatch, how
):
    """examples/moons as its README runs it (hydra.searchpath=[pkg://moons.conf], PYTHONPATH for that one command),
    and the same configs given by `--config-dir DIR --config-name NAME` (a path with a space): resume and evaluate
    need them to compose the run and to build its classes, and are refused (exit 2) without them; pasted into a
    shell without that PYTHONPATH, they carry it."""
    monkeypatch.setenv(
        "PYTHONPATH", str(MOONS)
    )  # the example's package importable, as in its README
    cwd, out = tmp_path / "the cwd", tmp_path / "o u t"
    if how == "searchpath":
        configs = ["hydra.searchpath=[pkg://moons.conf]"]
    else:
        import shutil

        mine = cwd / "my conf"  # relative on the command line: the summary must not depend on it
        shutil.copytree(MOONS / "moons" / "conf", mine)
        (mine / "mine.yaml").write_text(
            "defaults:\n  - config\n  - _self_\n"
        )  # the pipeline's, through mine
        configs = ["--config-dir", "my conf", "--config-name", "mine"]
    args = [
        *configs,
        "experiment=moons",
        "tracking=none",
        "trainer.progress_bar=false",
        "trainer.max_steps=16",
        f"paths.output_dir={out}",
    ]
    proc = run_pipeline(args, cwd)
    assert proc.returncode == 0, proc.stderr
    said = _summary_of(proc.stdout)
    final = RunDir(the_run(out)).store.root / "best"
    assert str(final) in shlex.split(said["evaluate"])
    done = _pasted(said, cwd, {k: v for k, v in env_for_subprocess().items() if k != "PYTHONPATH"})
    assert set(done) == {"resume", "evaluate"}  # no sample: not a text model
    for key, ran in done.items():
        assert ran.returncode == 0, (key, said[key], ran.stderr)
    assert "is complete at step 16" in done["resume"].stdout
    assert re.fullmatch(r"step=16 val/loss=\S+\n", done["evaluate"].stdout)


def test_the_tools_get_the_runs_config_directories_as_one_search_path():
    assert tool_args(["experiment=moons", "x.y=1"]) == []
    assert tool_args(["hydra.searchpath=[pkg://moons.conf]", "x=1"]) == [
        "hydra.searchpath=[pkg://moons.conf]"
    ]
    assert tool_args(
        ["--config-dir", "/a b/c", "--config-name", "mine", "hydra.searchpath=[pkg://m.conf]"]
    ) == ['hydra.searchpath=["file:///a b/c",pkg://m.conf]']
    assert tool_args(["--config-path", "/x", "--config-dir", "/y", "--config-name", "z"]) == [
        "hydra.searchpath=[file:///x,file:///y]"
    ]  # any directory name: tests/config/test_quoting.py


def _ui(tracking_uri: str, experiment_id: str | None) -> list[str]:
    block = end_block(
        status="complete",
        step=1,
        run_dir=PROJECT_ROOT,
        best=None,
        links={"final": None},
        curve=None,
        run_uri=None,
        tracking_uri=tracking_uri,
        overrides=[],
        samples=False,
        experiment_id=experiment_id,
    )
    return [ln for ln in block.splitlines() if ln.startswith(("  mlflow ui", "  then open"))]


def test_the_ui_line_is_a_servers_own_page_and_a_local_stores_command():
    assert _ui("http://127.0.0.1:5005", "7") == [
        "  mlflow ui   http://127.0.0.1:5005/#/experiments/7?workflowType=machine_learning"
    ]
    assert _ui("https://host/mlflow/", None) == [
        "  mlflow ui   https://host/mlflow/#/experiments?workflowType=machine_learning"
    ]  # not indexed yet
    assert _ui("sqlite:////tmp/a b/mlflow.db", "3") == [
        "  mlflow ui   mlflow ui --backend-store-uri 'sqlite:////tmp/a b/mlflow.db'",
        "  then open   http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning",
    ]
    assert _ui(None, None) == []


@pytest.mark.slow
@SHARED_SERVER
def test_under_a_tracking_server_the_ui_line_is_its_experiments_page(
    tmp_path, shared_mlflow_server
):
    """The server's own address (no `mlflow ui --backend-store-uri http://...`: a traceback), on the page of
    the experiment the run went to once the tracking agent has said which (else the list of experiments: the
    summary does not wait for it), in the machine-learning view; the page answers."""
    import urllib.request

    from mlflow import MlflowClient

    server, name = shared_mlflow_server[0], "end-summary-ui"
    env = {
        **env_for_subprocess(),
        "PIPELINE_TRACKING_AGENT_IDLE": "30",
    }  # the second run finds it warm
    client, pages = MlflowClient(server), []
    for seed in (1, 2):
        args = [
            "experiment=kernodeck",
            "trainer.progress_bar=false",
            "tracking=server",
            f"tracking.uri={server}",
            f"tracking.experiment={name}",
            "tracking.wait=60",
            "trainer.max_steps=200",
            f"trainer.seed={seed}",
            f"paths.output_dir={tmp_path / str(seed)}",
        ]
        (tmp_path / "cwd").mkdir(exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            cwd=tmp_path / "cwd",
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        said = _summary_of(proc.stdout)
        assert "then open" not in said and "--backend-store-uri" not in proc.stdout
        page = re.fullmatch(
            re.escape(server) + r"/#/experiments(?:/(\w+))?\?workflowType=machine_learning",
            said["mlflow ui"],
        )
        assert page, said["mlflow ui"]
        wait_until(lambda: client.get_experiment_by_name(name) is not None, "the run's experiment")
        experiment = client.get_experiment_by_name(name).experiment_id
        if said["mlflow"].startswith(server):  # the run's URI known: the page is its experiment's
            assert page[1] == experiment and f"#/experiments/{experiment}/runs/" in said["mlflow"]
        else:
            assert said["mlflow"] == "not indexed yet" and page[1] is None
        pages.append(said["mlflow ui"])
        with urllib.request.urlopen(said["mlflow ui"].partition("#")[0], timeout=60) as r:
            assert r.status == 200 and b"<html" in r.read().lower()
    assert (
        pages[1] == f"{server}/#/experiments/{experiment}?workflowType=machine_learning"
    )  # a warm agent
