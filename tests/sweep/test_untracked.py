"""A sweep with tracking=none is a room of its own: it imports nothing of pipeline/tracking/ and asks for no parent."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import KERNODECK, env_for_subprocess

from pipeline.run.tracker import SweepParent
from pipeline.sweep.callback import parent_run


def test_a_sweep_with_tracking_none_imports_nothing_of_tracking(tmp_path):
    """`python -m pipeline -m ... tracking=none`, its modules listed as the process exits (jobs run in it)."""
    out, listing = tmp_path / "out", tmp_path / "modules.txt"
    args = ["pipeline", "-m", *KERNODECK, "optimizer.lr=1e-3,3e-3", f"paths.output_dir={out}"]
    code = (
        "import atexit, runpy, sys\n"
        f"atexit.register(lambda: open({str(listing)!r}, 'w').write('\\n'.join(sorted(sys.modules))))\n"
        f"sys.argv = {args!r}\n"
        "runpy.run_module('pipeline', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env_for_subprocess(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = listing.read_text().split()
    assert (
        "pipeline.sweep.callback" in imported and "pipeline.run.job" in imported
    )  # the sweep and its jobs ran
    assert [m for m in imported if m.startswith(("pipeline.tracking", "mlflow"))] == []
    (sweep,) = (out / "sweeps").iterdir()
    record = json.loads((sweep / "sweep.json").read_text())
    assert "uri" not in record and record["status"] == "complete"
    assert "parent: not tracked (tracking=none)" in proc.stderr


def test_the_parent_run_comes_through_the_trackers_interface(compose_cfg, tmp_path):
    assert type(parent_run(compose_cfg("tracking=none").tracking)) is SweepParent
    assert type(parent_run(None)) is SweepParent
    mlflow = parent_run(compose_cfg("tracking=mlflow", f"paths.output_dir={tmp_path}").tracking)
    assert type(mlflow).__module__ == "pipeline.tracking.sweep_parent"
    assert mlflow.uri == f"sqlite:///{tmp_path}/mlflow.db"
