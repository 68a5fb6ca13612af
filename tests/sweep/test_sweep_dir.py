"""A sweep's directory under an output directory of any name: the launcher's and every job's (sweep/callback.py)."""
from __future__ import annotations

import json

from conftest import KERNODECK, run_pipeline

from pipeline.config.targets import hydra_quoted, literal


def test_a_sweep_runs_under_an_output_directory_with_quotes_backslashes_and_interpolations(tmp_path):
    out = tmp_path / "it's \"${x}\" a\\${y} \\ b"
    given = f"paths.output_dir={hydra_quoted(literal(str(out)))}"
    proc = run_pipeline(["-m", *KERNODECK, "optimizer.lr=1e-3,3e-3", given], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (out / "sweeps").iterdir()
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["dir"] == str(sweep) and record["status"] == "complete"
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]  # each job's Hydra output
    assert len(list((out / "runs").iterdir())) == 2
