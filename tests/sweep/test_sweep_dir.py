"""An output directory of any name: the sweep's directory (sweep/callback.py), its jobs' records and the resume
command each job prints (__main__.py) keep its quotes, backslashes and `${` as they were given."""

from __future__ import annotations

import json
import re

import yaml
from conftest import KERNODECK, pasted, run_pipeline

from pipeline.config.targets import hydra_quoted, literal


def test_a_sweep_and_its_jobs_resume_commands_keep_an_output_directory_with_quotes_backslashes_and_interpolations(
    tmp_path,
):
    out = tmp_path / 'it\'s "${x}" a\\${y} \\ b'
    given = f"paths.output_dir={hydra_quoted(literal(str(out)))}"
    proc = run_pipeline(["-m", *KERNODECK, "optimizer.lr=1e-3,3e-3", given], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (out / "sweeps").iterdir()
    record = json.loads((sweep / "sweep.json").read_text())
    assert (
        record["dir"] == str(sweep)
        and record["status"] == "complete"
        and given in record["overrides"]
    )
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == [
        "0",
        "1",
    ]  # each job's Hydra output
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2 and all(
        given in yaml.safe_load((r / ".hydra" / "overrides.yaml").read_text()) for r in runs
    )
    resume = re.findall(r"^  resume +(.*)$", proc.stdout, re.M)[-1]
    again = pasted(resume, tmp_path)
    assert again.returncode == 0 and "is complete at step" in again.stdout, (
        resume,
        again.stderr[-2000:],
    )
