"""The addresses a job and a sweep print, opened as a user opens them: `mlflow ui` on the store, and each page
loaded in headless Chromium (Debian's `chromium`), in the runs view, showing the runs by their names."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_for_subprocess
from mlflow_servers import mlflow_server

from pipeline.tracking.link import wait_idle

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"no {CHROMIUM}: install Debian's `chromium` (.ci/run does, as root with apt-get)",
    ),
]
UI_LOCAL = "http://127.0.0.1:5000"  # where the printed addresses expect `mlflow ui`


def mlflow_ui(uri: str, root: Path):
    """`mlflow ui` serving the store at `uri` on 127.0.0.1 and a free port, until the block ends: its address."""
    return mlflow_server(root, backend=uri, command="ui")


def page_text(address: str, profile: Path) -> str:
    """The page's text once mlflow's app has rendered it (its title first), as headless Chromium dumps it."""
    done = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=30000",
            "--dump-dom",
            address,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", done.stdout, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m pipeline *args` with the tracking agent kept warm between the commands (the second finds it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**env_for_subprocess(), "PIPELINE_TRACKING_AGENT_IDLE": "60"},
    )


def printed(lines: list[str], prefix: str) -> str | None:
    """The address a line starting with `prefix` ends with, None if it names none."""
    line = next((ln for ln in lines if ln.lstrip().startswith(prefix)), "")
    found = re.search(r"(http://\S+)$", line)
    return found[1] if found else None


def test_the_printed_addresses_open_the_runs_view_with_the_runs_names(tmp_path):
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    uri = f"sqlite:///{out}/mlflow.db"
    sweep_args = [
        "-m",
        "experiment=kernodeck",
        "trainer.progress_bar=false",
        f"paths.output_dir={out}",
        "tracking.wait=60",
        "optimizer.lr=0.0031622776601683794,0.03",
    ]
    sweep = run(sweep_args, cwd)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    single = run(
        [
            "experiment=kernodeck",
            "trainer.progress_bar=false",
            f"paths.output_dir={out}",
            "tracking.wait=60",
            "trainer.seed=7",
        ],
        cwd,
    )  # the agent is warm: the summary has the run's page
    assert single.returncode == 0, single.stderr[-3000:]
    assert wait_idle(uri)
    table = sweep.stderr.splitlines()
    if (
        printed(table, "parent:") is None
    ):  # the agent had not answered at the end: the same command says it now
        table = run(sweep_args, cwd).stderr.splitlines()
    summary = single.stdout.splitlines()
    pages = {
        "then open": printed(summary, "then open"),
        "parent": printed(table, "parent:"),
        "its runs": printed(table, "its runs:"),
        "best": printed(table, "best:"),
        "mlflow": printed(summary, "mlflow "),
    }
    assert pages["then open"] and pages["parent"] and pages["its runs"], (summary, table)
    with mlflow_ui(uri, tmp_path) as ui:
        seen = {
            k: page_text(v.replace(UI_LOCAL, ui), tmp_path / "profile")
            for k, v in pages.items()
            if v
        }
    if (
        "/#/experiments?" in pages["then open"]
    ):  # the run was not indexed yet: the page of every experiment
        assert "Experiments - MLflow" in seen["then open"] and " kernodeck " in seen["then open"]
        del seen["then open"]
    for key in {"then open", "its runs"} & set(seen):  # the runs view, not the GenAI overview
        assert "Runs - Experiment" in seen[key] and "Run Name" in seen[key], (key, seen[key][:600])
        assert "Overview - Experiment" not in seen[key] and " kernodeck " in seen[key], seen[key][
            :600
        ]
    parent = seen["parent"]
    assert "lr sweep" in parent and "Child runs" in parent, parent[:2000]
    assert "optimizer.lr=0.003162" in parent and "optimizer.lr=0.03" in parent, parent[:2000]
    assert "optimizer.lr=0.0031622776601683794" in parent  # the exact value: in the parent's params
    if "best" in seen:  # the winner's own page
        assert "optimizer.lr=0.03" in seen["best"] and "Model metrics" in seen["best"], seen[
            "best"
        ][:1000]
    if "mlflow" in seen:  # the single run's page
        assert (
            re.search(r"Run [0-9a-f]{32}", seen["mlflow"]) and "Model metrics" in seen["mlflow"]
        ), seen["mlflow"][:1000]
