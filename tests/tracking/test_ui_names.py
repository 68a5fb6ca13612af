"""What mlflow's UI shows of a job and a sweep: the experiment's name, the runs' names, the addresses printed."""

from __future__ import annotations

from pipeline.config.identity import experiment_name
from pipeline.run.report import end_block, run_page
from pipeline.sweep.callback import job_name
from pipeline.sweep.summary import parent_name, shown_value, sweep_table
from pipeline.tracking.common import experiment_of
from tests.conftest import PROJECT_ROOT, config_of

RID = "0123456789abcdef0123456789abcdef"
RUNS_VIEW = "?workflowType=machine_learning"


def test_the_experiment_is_the_experiment_configs_name_and_the_default_jobs_its_data_and_model():
    assert (
        config_of()["tracking"]["experiment"] == "grammar-minigpt"
    )  # never `default`, beside mlflow's `Default`
    assert config_of()["name"] == "default"  # the run directory keeps its name
    assert config_of("experiment=kernodeck")["tracking"]["experiment"] == "kernodeck"
    assert config_of("model=mlp", "data=regression")["tracking"]["experiment"] == "regression-mlp"
    assert config_of("name=mine")["tracking"]["experiment"] == "mine"
    assert config_of("tracking.experiment=team")["tracking"]["experiment"] == "team"
    assert (
        experiment_name("default", "x.model.minigpt.MiniGPT", "x.data.text.TextCorpus")
        == "text-minigpt"
    )


def test_a_config_tracked_by_none_is_indexed_into_the_experiment_mlflow_tracking_would_have_used():
    untracked = config_of("tracking=none")
    assert "experiment" not in untracked["tracking"]
    assert experiment_of(untracked) == "grammar-minigpt" == experiment_of(config_of())
    assert experiment_of(config_of("tracking=none", "experiment=kernodeck")) == "kernodeck"


def test_swept_floats_show_four_significant_digits_in_names_and_the_rest_as_written():
    assert shown_value("0.0031622776601683794") == "0.003162"
    assert shown_value("123456.7") == "1.235e+05"
    for kept in ("0.03", "1.0", "1e-4", "2", "[4]", "adam", "-0.5", "0.003162"):
        assert shown_value(kept) == kept
    keys = {"optimizer.lr": "tag(log, interval(1e-4, 1e-2))", "model.n_layer": "choice(1, 2, 3)"}
    assert (
        job_name(
            ["optimizer.lr=0.0031622776601683794", "model.n_layer=2", "paths.output_dir=/o"], keys
        )
        == "optimizer.lr=0.003162 model.n_layer=2"
    )


def test_a_sweeps_parent_is_named_by_what_it_sweeps():
    assert parent_name({"optimizer.lr": "a", "model.n_layer": "b"}) == "lr×n_layer sweep"
    assert (
        parent_name({"optimizer.lr": "a", "scheduler.lr": "b"}) == "optimizer.lr×scheduler.lr sweep"
    )
    assert parent_name({}) == "sweep"


def test_every_printed_address_opens_the_runs_view():
    for store, ui in (
        ("sqlite:////tmp/o/mlflow.db", "http://127.0.0.1:5000"),
        ("http://h:5005", "http://h:5005"),
    ):
        uri = f"{store}#/experiments/3/runs/{RID}"
        assert run_page(uri) == f"{ui}/#/experiments/3/runs/{RID}{RUNS_VIEW}"
        block = end_block(
            status="complete",
            step=1,
            run_dir=PROJECT_ROOT,
            best=None,
            links={"final": None},
            curve=None,
            run_uri=uri,
            tracking_uri=store,
            overrides=[],
            samples=False,
            experiment_id="3",
        )
        assert f"  mlflow      {ui}/#/experiments/3/runs/{RID}{RUNS_VIEW}" in block.splitlines()
        sweep = {
            "id": "s",
            "name": "n",
            "swept": {"optimizer.lr": "0.1,0.3"},
            "uri": store,
            "direction": "minimize",
        }
        jobs = {
            0: {
                "num": 0,
                "overrides": ["optimizer.lr=0.1"],
                "objective": 1.0,
                "status": "complete",
                "name": "optimizer.lr=0.1",
                "run_uri": uri,
            }
        }
        table = sweep_table(sweep, jobs, jobs[0], [run_page(uri), "its runs: x"])
        assert (
            table[-3]
            == f"best: job 0 (optimizer.lr=0.1) {ui}/#/experiments/3/runs/{RID}{RUNS_VIEW}"
        )
        assert table[-2] == f"parent: {ui}/#/experiments/3/runs/{RID}{RUNS_VIEW}"
