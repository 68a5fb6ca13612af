"""What a sweep's launcher says at its end: its table's numbers, the command that serves its UI, and a SLURM it
could not reach."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from conftest import KERNODECK, env_for_subprocess

from pipeline.config.errors import EXIT_UNAVAILABLE


def launch(out, *overrides: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {
        **env_for_subprocess(),
        "PIPELINE_TRACKING_AGENT_IDLE": "60",
    }  # a second launch finds the agent warm
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "-m",
            *KERNODECK[:1],
            "trainer.max_steps=2",
            f"paths.output_dir={out}",
            *overrides,
        ],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_the_table_shows_six_significant_digits_and_the_ui_command_is_quoted_for_a_path_with_spaces(
    tmp_path,
):
    out = tmp_path / "my outputs"
    args = ("tracking=mlflow", "tracking.wait=60", "optimizer.lr=0.00024156772025296256,0.01")
    proc = launch(out, *args)
    if (
        "\nits runs: " not in proc.stderr
    ):  # the agent had not answered at the end: the same command says it now
        proc = launch(out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    rows = [
        line.split()
        for line in lines[lines.index(next(x for x in lines if x.startswith("sweep "))) + 2 :][:2]
    ]
    assert [r[-3] for r in rows] == [
        "0.000241568",
        "0.01",
    ]  # as a job's lines print numbers (`:.6g`)
    (runs,) = [line for line in lines if line.startswith("its runs: ")]
    command = runs.removeprefix("its runs: `").split("`, then ")[0]
    assert shlex.split(command) == [
        "mlflow",
        "ui",
        "--backend-store-uri",
        f"sqlite:///{out}/mlflow.db",
    ]


@pytest.mark.parametrize("client", ["unreachable", "missing"])
def test_a_slurm_that_cannot_be_reached_is_said_so_with_its_own_code_and_nothing_is_left(
    tmp_path, client
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if client == "unreachable":  # what sbatch says without a controller (SLURM's own words)
        (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "sbatch").write_text(
            "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to "
            "contact slurm controller (connect failure)' >&2\nexit 1\n"
        )
        for f in bin_dir.iterdir():
            f.chmod(0o755)
    out = tmp_path / "out"
    proc = launch(
        out, "tracking=none", "hydra/launcher=slurm", "optimizer.lr=0.01,0.02", path=str(bin_dir)
    )
    assert proc.returncode == EXIT_UNAVAILABLE == 69, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("pipeline: SLURM could not be reached: ")
        and "bad config" not in proc.stderr
    )
    assert ("Unable to contact slurm controller" in last) == (client == "unreachable")
    assert not out.exists()  # nothing was submitted: the sweep's start is undone


@pytest.mark.parametrize(
    ("status", "jobs", "code"),
    [
        ("completed", {0: {"status": "complete"}, 1: {"status": "complete"}}, 0),
        ("interrupted", {0: {"status": "complete"}, 1: {"code": 75}}, 75),
        ("failed", {1: {"code": 3}, 0: {"code": 2}}, 2),
    ],
)
def test_a_sweeps_end_is_a_code_the_entry_exits_with_not_an_exit_inside_hydra(
    monkeypatch, capsys, tmp_path, status, jobs, code
):
    from pipeline.sweep import callback

    monkeypatch.setattr(callback, "read_jobs", lambda directory: jobs)
    monkeypatch.setattr(callback, "best_job", lambda jobs, sweep: None)
    monkeypatch.setattr(callback, "sweep_table", lambda *args: ["the table"])
    sweep = callback.SweepCallback()
    sweep.sweep = {"id": "x", "dir": str(tmp_path)}
    assert sweep.on_multirun_end(None) is None  # Hydra's callback returns: only the entry exits
    assert sweep.code == code
    err = capsys.readouterr().err
    assert err.startswith("the table\n") and ("interrupted" in err) == (status == "interrupted")


def test_an_exception_after_a_sweeps_end_is_raised_not_turned_into_that_ends_code(tmp_path):
    from pipeline.sweep.callback import SweepCallback

    sweep = SweepCallback()
    sweep.sweep, sweep.code = {"dir": str(tmp_path)}, 0  # ended, then something raised
    (tmp_path / "sweep.json").write_text('{"status": "complete"}')
    assert sweep.raised(RuntimeError("after the end"), job_began=True) is None
