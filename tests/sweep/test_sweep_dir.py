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


def test_a_sweep_json_that_is_not_an_object_is_rewritten_by_the_same_sweep_not_a_traceback(
    tmp_path,
):
    args = ["-m", *KERNODECK, "optimizer.lr=1e-3", f"paths.output_dir={tmp_path / 'out'}"]
    assert run_pipeline(args, tmp_path).returncode == 0
    (sweep,) = (tmp_path / "out" / "sweeps").iterdir()
    (sweep / "sweep.json").write_text("[]")
    again = run_pipeline(args, tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert json.loads((sweep / "sweep.json").read_text())["status"] == "complete"


def test_a_launcher_ends_only_its_own_sweep_whatever_its_sweep_json_holds(tmp_path):
    from pipeline.sweep.callback import SweepCallback

    sweep = SweepCallback()
    sweep.sweep = {"dir": str(tmp_path)}
    for text in ("[]", '"x"', "3", '{"pid": 1}'):
        (tmp_path / "sweep.json").write_text(text)
        assert sweep.end_unfinished("boom") is False and sweep.code is None
