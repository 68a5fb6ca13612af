"""Tracking pieces that need no subprocess: URIs, params, the config group, the tracker without mlflow."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest

from pipeline.tracking.common import (
    flatten,
    metric_points,
    normalize_tracking_uri,
    param_value,
    params_of,
    parse_run_uri,
    run_uri,
    tags_of,
)

RID = "0123456789abcdef0123456789abcdef"
MLFLOW_TRACKER = "pipeline.tracking.mlflow_tracker.MlflowTracker"


def test_run_uri_round_trips_for_sqlite_and_http():
    for base in ("sqlite:////abs/outputs/mlflow.db", "http://127.0.0.1:5000"):
        uri = run_uri(base, "7", RID)
        assert uri == f"{base}#/experiments/7/runs/{RID}"
        assert parse_run_uri(uri) == (base, "7", RID)


def test_parse_run_uri_accepts_mlflow_forms_and_rejects_the_rest():
    assert parse_run_uri(f"runs:/{RID}") == (None, None, RID)
    assert parse_run_uri(f"runs:/{RID}/model") == (None, None, RID)
    assert parse_run_uri(RID) == (None, None, RID)
    assert parse_run_uri(None) == (None, None, None)
    assert parse_run_uri("sqlite:///x.db") == (None, None, None)
    assert parse_run_uri("sqlite:///x.db#/experiments/1/runs/nothex") == (
        "sqlite:///x.db",
        None,
        None,
    )


def test_sqlite_uri_is_made_absolute_whatever_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        normalize_tracking_uri("sqlite:///out/mlflow.db")
        == f"sqlite:///{tmp_path.resolve()}/out/mlflow.db"
    )
    assert normalize_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert normalize_tracking_uri("http://h:1") == "http://h:1"


def test_params_are_the_flattened_config_with_dotted_keys_and_bounded_values():
    config = {
        "name": "x",
        "optimizer": {"lr": 0.03, "betas": [0.9, 0.999]},
        "resume": {"allow_changes": []},
        "model": {"hidden": [8], "dropout": None, "act": "tanh"},
        "hydra": {"ignored": 1},
    }
    params = params_of(config)
    assert params == {
        "name": "x",
        "optimizer.lr": "0.03",
        "optimizer.betas": "[0.9, 0.999]",
        "model.hidden": "[8]",
        "model.dropout": "null",
        "model.act": "tanh",
    }  # machine keys left out
    tags = tags_of(
        {"config": {**config, "paths": {"output_dir": "/o"}}},
        "/r",
        {"resumes": [{"step": 5}]},
        {
            "name": "optimizer.lr=0.03",
            "num": 2,
            "sweep_id": "abc",
            "overrides": ["optimizer.lr=0.03"],
        },
    )
    assert not any(k.startswith("config.") for k in tags)  # no machine key worth a tag is set here
    assert (
        tags["resumes"] == "1"
        and tags["resume.1"] == "5"
        and tags["mlflow.runName"] == "optimizer.lr=0.03"
    )
    assert tags["sweep.job_num"] == "2" and tags["sweep.id"] == "abc"
    assert flatten({"a": {}}) == {"a": {}}
    assert len(param_value("x" * 10_000)) <= 6000


def test_tracking_group_defaults_to_mlflow_under_the_output_dir(compose_cfg, tmp_path):
    cfg = compose_cfg(
        "experiment=kernodeck", f"paths.output_dir={tmp_path}", return_hydra_config=True
    )
    assert cfg.tracking._target_ == "pipeline.tracking.mlflow_tracker.MlflowTracker"
    assert cfg.tracking.uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert cfg.tracking.artifact_location == f"{tmp_path}/mlartifacts"
    assert cfg.tracking.experiment == "kernodeck"
    assert cfg.tracking._target_ == MLFLOW_TRACKER
    assert "mlflow_sweep" in cfg.hydra.callbacks
    default = compose_cfg()
    assert Path(default.tracking.uri[len("sqlite:///") :]).is_absolute()
    server = compose_cfg("tracking=server", "tracking.uri=http://127.0.0.1:5999")
    assert (
        server.tracking.uri == "http://127.0.0.1:5999"
        and server.tracking._target_ == MLFLOW_TRACKER
    )
    assert compose_cfg("tracking=none").tracking.get("_target_") != MLFLOW_TRACKER


def test_tracker_module_does_not_import_mlflow():
    import subprocess

    code = (
        "import sys, pipeline.tracking.mlflow_tracker, pipeline.sweep.callback, "
        "pipeline.run.job; print('mlflow' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "False", out.stderr


def test_tracker_that_cannot_start_its_agent_warns_once_and_stays_quiet(
    monkeypatch, caplog, tmp_path
):
    from pipeline.tracking import mlflow_tracker

    def broken():
        raise OSError("no agent today")

    import pipeline.tracking.link as link

    monkeypatch.setattr(link, "agent_for", lambda *args: broken())
    t = mlflow_tracker.MlflowTracker(
        uri=f"sqlite:///{tmp_path}/m.db", experiment="e", artifact_location=None, wait=1.0
    )
    t.prepare()
    t.start(config={"name": "e"}, facts={}, run_dir=tmp_path, previous_run_uri=None)
    t.log_line({"step": 1, "epoch": 0, "time": 0.0, "train/loss": 1.0})
    assert t.run_uri(timeout=5.0) is None
    t.finish("FINISHED", tmp_path)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no agent today" in warnings[0].getMessage()


def test_non_finite_metric_values_reach_mlflow_as_floats():
    points = {
        k: v
        for k, v, _, _ in metric_points(
            {"step": 3, "time": 1.0, "a": "NaN", "b": "Infinity", "c": 1}
        )
    }
    assert math.isnan(points["a"]) and points["b"] == math.inf and points["c"] == 1.0


def test_swept_keys_and_job_names():
    from pipeline.sweep.callback import job_name, swept

    keys = swept(
        [
            "experiment=kernodeck",
            "optimizer.lr=0.01,0.03",
            "model.hidden=[4],[8]",
            "paths.output_dir=/o",
        ],
        {"trainer.seed": "range(0,3)"},
    )
    assert keys == {
        "optimizer.lr": "0.01,0.03",
        "model.hidden": "[4],[8]",
        "trainer.seed": "range(0,3)",
    }
    assert (
        job_name(
            [
                "experiment=kernodeck",
                "optimizer.lr=0.03",
                "model.hidden=[4]",
                "paths.output_dir=/o",
            ],
            keys,
        )
        == "optimizer.lr=0.03 model.hidden=[4]"
    )


def test_importing_the_mlflow_side_changes_no_more_of_the_environment_than_mlflow_itself():
    """No process globals on import: the HTTP settings are set where a client is opened (store.open_store)."""
    import subprocess

    code = (
        "import os, sys; before = dict(os.environ); __import__(sys.argv[1]); "
        "print(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)))"
    )
    changed = {
        m: set(
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", code, m],
                    capture_output=True,
                    text=True,
                    cwd=Path(__file__).resolve().parents[2],
                )
                .stdout.strip()
                .replace("'", '"')
            )
        )
        for m in ("mlflow", "pipeline.tracking.store", "pipeline.tracking.agent")
    }
    # mlflow's own import may set its telemetry session id (not every time): ours add nothing to what it sets
    assert changed["pipeline.tracking.store"] <= changed["mlflow"], changed
    assert changed["pipeline.tracking.agent"] <= changed["mlflow"], changed
    assert not any(k.startswith("MLFLOW_HTTP_") for k in set().union(*changed.values())), changed


def test_importing_the_mlflow_side_changes_no_logger_level_and_opening_a_store_quiets_its_migrations(
    tmp_path,
):
    """No process globals on import: mlflow's and alembic's migration loggers are set to WARNING where a store is
    first opened (store.open_store), not when pipeline.tracking.store is imported."""
    import subprocess

    code = (
        "import json, logging, sys\n"
        "import mlflow, mlflow.store.tracking.sqlalchemy_store\n"  # what mlflow's own imports set
        "def levels():\n"
        "    loggers = logging.root.manager.loggerDict.items()\n"
        "    return {n: g.level for n, g in loggers if isinstance(g, logging.Logger)} | {'': logging.root.level}\n"
        "before = levels()\n"
        "from pipeline.tracking import store\n"
        "after = levels()\n"
        "changed = sorted(n for n in after if after[n] != before.get(n, logging.NOTSET))\n"
        "store.open_store(sys.argv[1])\n"
        "opened = {n: logging.getLogger(n).level for n in ('mlflow.store.db.utils', 'alembic')}\n"
        "print(json.dumps([changed, opened]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{tmp_path}/m.db"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    changed, opened = json.loads(proc.stdout.strip().splitlines()[-1])
    assert changed == []
    assert opened == {"mlflow.store.db.utils": logging.WARNING, "alembic": logging.WARNING}


def test_opening_a_client_sets_mlflows_http_settings_unless_the_user_did(tmp_path, monkeypatch):
    from pipeline.tracking import store

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    store.open_store(f"sqlite:///{tmp_path}/m.db")
    assert (
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"],
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"],
    ) == ("2", "7")


def test_a_small_artifact_is_read_bounded_never_from_a_fifo_or_a_device(tmp_path):
    """The index compares small artifacts by content: what it reads is a regular file within the bound."""
    from pipeline.files.reading import UnreadableFile
    from pipeline.tracking.index import MAX_COMPARED_BYTES, _bytes_of

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * (MAX_COMPARED_BYTES + 1))
    for path, why in (
        (tmp_path / "fifo", "FIFO"),
        (Path("/dev/zero"), "character device"),
        (tmp_path / "big", "over the"),
    ):
        with pytest.raises(UnreadableFile, match=why):
            _bytes_of(path)
    (tmp_path / "ok").write_bytes(b"overrides")
    assert _bytes_of(tmp_path / "ok") == b"overrides" and _bytes_of(b"raw") == b"raw"
