"""examples/moons: a model and a dataset from outside the package, by config only (hydra.searchpath), trained,
resumed byte-identically, verified by `python -m pipeline.verify`, evaluated and inspected with its search path
(refused in one line without it); its backward checked against finite differences."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import (
    PROJECT_ROOT,
    central_differences,
    config_of,
    kept,
    metrics,
    refused_in_one_line,
    run_job,
    run_pipeline,
    the_run,
)

from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.run.directory import RunDir
from pipeline.run.signals import SIGNALS_STATE

EXAMPLE = PROJECT_ROOT / "examples" / "moons"
MOONS = (
    "hydra.searchpath=[pkg://moons.conf]",
    "experiment=moons",
    "tracking=none",
    "trainer.progress_bar=false",
)


@pytest.fixture
def moons(monkeypatch):
    """The example's package importable, here and in subprocesses (as PYTHONPATH=examples/moons does)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    return MOONS


def test_rbf_gradients_match_finite_differences(moons):
    from moons.data import TwoMoons
    from moons.model import RBFNet

    data = TwoMoons(n_train=16, n_val=4, noise=0.1, jitter=0.05, seed=1)
    model = RBFNet(
        data.spec,
        n_centers=5,
        dropout=0.3,
        init_scale=1.0,
        dtype="float64",
        rng=np.random.default_rng(0),
    )
    batch = data.train_batch(np.arange(16), np.float64)

    def loss() -> float:  # the same dropout mask every time: a fresh generator with one seed
        return model.loss_and_grads(batch, np.random.default_rng(7))[0]

    _, grads = model.loss_and_grads(batch, np.random.default_rng(7))
    for name, p in model.params.items():
        numeric = central_differences(loss, p)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_the_example_composes_from_its_own_config_directory(moons, tmp_path):
    config = config_of(*moons, f"paths.output_dir={tmp_path}")
    assert (
        config["model"]["_target_"] == "moons.model.RBFNet"
        and config["data"]["_target_"] == "moons.data.TwoMoons"
    )
    assert (
        config["optimizer"]["_target_"] == "pipeline.optimizer.adam.Adam"
        and config["name"] == "moons"
    )
    code, _ = run_job(
        "hydra.searchpath=[pkg://moons.conf]",
        "model=rbf",
        "tracking=none",
        f"paths.output_dir={tmp_path / 'out'}",
    )  # with the default data: grammar tokens
    assert code == 2 and not (tmp_path / "out" / "runs").exists()


def test_a_key_its_class_does_not_take_is_one_line_exit_2(moons, tmp_path, capsys):
    """Its configs have no schema: a typo reaches the constructor, and is named there, before anything starts."""
    code, _ = run_job(*moons, "+model.n_centres=8", f"paths.output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out" / "runs").exists()
    assert "moons.model.RBFNet takes no argument 'n_centres'" in err and "n_centers" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("k", [13, 70])
def test_it_trains_and_resumes_byte_identically(moons, tmp_path, preempt_at, k):
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_job(*moons, f"paths.output_dir={ref}")[0] == 0
    status = RunDir(the_run(ref)).read_status()
    assert (
        status["step"] == 160 and status["metrics"]["val/loss"] < 0.2
    )  # it learns: chance is log 2 = 0.69
    preempt_at(k)
    assert run_job(*moons, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*moons, f"paths.output_dir={out}")[0] == 0
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))


def test_the_verifier_proves_its_resume_and_evaluate_reads_it(moons, tmp_path):
    out = tmp_path / "out"
    proc = run_pipeline(
        [*moons, "verify.cut=13", "verify.steps=30", f"paths.output_dir={out}"],
        tmp_path / "cwd",
        module="pipeline.verify",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = (out / "verify").glob("*/verification.json")
    report = json.loads(report.read_text())
    assert report["all_checks_passed"] and report["max_weight_diff"]["positive"] == 0.0
    assert (
        report["max_weight_diff"]["negative"] > 0
    )  # dropout and jitter after the cut: the control diverges
    # the command a user types, from the README
    proc = run_pipeline(
        [*moons, "trainer.max_steps=16", f"paths.output_dir={out}"], tmp_path / "cwd"
    )
    assert proc.returncode == 0, proc.stderr
    final = RunDir(the_run(out)).store.root / "final"
    searchpath = MOONS[
        0
    ]  # its classes are named by its own configs: the tools that build them need them too
    proc = run_pipeline(
        [str(final), searchpath, "--json"], tmp_path / "cwd", module="pipeline.evaluate"
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((final / "manifest.json").read_text())
    assert json.loads(proc.stdout)["metrics"] == {"val/loss": manifest["metrics"]["val/loss"]}
    proc = run_pipeline([str(final), searchpath], tmp_path / "cwd", module="pipeline.show")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("valid"), (
        proc.stdout + proc.stderr
    )
    for module in ("pipeline.show", "pipeline.evaluate"):  # without them: refused, nothing imported
        said = refused_in_one_line([str(final)], tmp_path / "cwd", module=module)
        assert (
            said.startswith(
                f"{module}: checkpoint {final}: manifest.json: config.data._target_ names "
                "'moons.data.TwoMoons', which neither the pipeline's configs nor yours name"
            )
            and "hydra.searchpath=[...]" in said
        ), said
