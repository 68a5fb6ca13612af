"""Jobs run side by side (joblib) label their console lines with their job number; a run's own log stays as it is."""

from __future__ import annotations

import io
import logging
import re

import pytest
from conftest import KERNODECK, run_pipeline

from pipeline.run.job import label_console
from pipeline.trainer.metrics_log import QuietFileHandler


def test_each_line_of_a_record_carries_the_label_and_a_workers_next_job_relabels(monkeypatch):
    console, file = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers = [logging.StreamHandler(console), QuietFileHandler(file)]
    for h in handlers:
        h.setFormatter(logging.Formatter("[%(levelname)s] - %(message)s"))
    monkeypatch.setattr(root, "handlers", handlers)
    label_console("[job 3]")
    root.warning("done\n  best x")
    label_console("[job 5]")  # the same worker's next job
    root.warning("next")
    assert console.getvalue().splitlines() == [
        "[job 3] [WARNING] - done",
        "[job 3]   best x",
        "[job 5] [WARNING] - next",
    ]
    assert file.getvalue().splitlines() == ["[WARNING] - done", "  best x", "[WARNING] - next"]


@pytest.mark.slow
def test_a_joblib_sweeps_jobs_label_their_lines(tmp_path):
    out = tmp_path / "out"
    proc = run_pipeline(
        [
            "-m",
            *KERNODECK[:1],
            f"paths.output_dir={out}",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "optimizer.lr=0.01,0.02",
            "tracking=none",
            "trainer.progress_bar=false",
        ],
        tmp_path / "cwd",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "[pipeline]" in ln]
    assert lines and all(re.match(r"\[job [01]\] \[", ln) for ln in lines), lines
    for num, lr in (
        (0, "0.01"),
        (1, "0.02"),
    ):  # each job's own lines: its resume command names its value
        resume = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"[job {num}]   resume ")]
        assert len(resume) == 1 and f"optimizer.lr={lr} " in resume[0], resume
    for log in out.glob("runs/*/pipeline.log"):  # the run's own log: unlabelled
        assert not log.read_text().startswith("[job"), log
