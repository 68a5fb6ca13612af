"""A monitor names a metric the run logs: every stage's `monitor` and `optimized_metric` are checked against the
names the configured data and trainer measure (declared beside the code measuring them), before anything is
created; a typo is one line naming the key, the value and the closest names, exit 2, nothing on disk."""

from __future__ import annotations

import pytest
from conftest import KERNODECK, TINY, config_of, refused_in_one_line, run_job, the_run

from pipeline.config import identity
from pipeline.config.errors import ConfigError
from pipeline.run.assemble import assemble, check_monitors, metric_names
from pipeline.trainer.loop import fit, metrics_of


@pytest.mark.parametrize(
    "overrides, key",
    [
        (("stages.best_val.monitor=val/los",), "stages.best_val.monitor=val/los"),
        (
            ("+stages/early_stop=default", "stages.early_stop.monitor=val/los"),
            "stages.early_stop.monitor=val/los",
        ),
        (("optimized_metric=val/los",), "optimized_metric=val/los"),
    ],
)
def test_a_typo_in_a_monitor_is_refused_in_one_line_with_the_closest_name_and_nothing_on_disk(
    tmp_path, overrides, key
):
    out = tmp_path / "out"
    line = refused_in_one_line([*TINY, *overrides, f"paths.output_dir={out}"], tmp_path)
    assert line.startswith(f"pipeline: {key}: ") and "did you mean val/loss" in line, line
    assert "val/ppl" in line  # what it could be
    assert not out.exists()


def test_a_refused_monitor_leaves_an_existing_output_directory_as_it_was(tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "note").write_text("mine")
    refused_in_one_line(
        [*KERNODECK, "stages.best_val.monitor=val/ppl", f"paths.output_dir={out}"], tmp_path
    )
    assert (
        sorted(p.name for p in out.rglob("*")) == ["note", "runs"]
        and (out / "note").read_text() == "mine"
    )


def test_the_names_depend_on_the_data_and_the_trainer():
    tokens, rows = config_of(*TINY), config_of(*KERNODECK)
    assert {"val/loss", "val/ppl", "train/ppl", "val/ngram_baseline_ppl"} <= set(
        metric_names(tokens)
    )
    assert "val/ppl" not in metric_names(rows) and "val/loss" in metric_names(rows)
    assert "clipped" not in metric_names(rows)
    assert "clipped" in metric_names(config_of(*KERNODECK, "trainer.grad_clip=1.0"))
    with pytest.raises(
        ConfigError, match=r"stages.best_val.monitor=val/ppl: .*did you mean val/loss\?"
    ):
        check_monitors(config_of(*KERNODECK, "stages.best_val.monitor=val/ppl"))


def test_optimized_metric_names_a_metric_whose_last_value_the_run_keeps():
    check_monitors(config_of(*KERNODECK, "optimized_metric=train/loss"))
    with pytest.raises(
        ConfigError, match=r"optimized_metric=lr: logged, but not a metric whose last value"
    ):
        check_monitors(config_of(*KERNODECK, "optimized_metric=lr"))  # objective() would read NaN


def test_a_monitor_of_a_stage_added_by_override_is_checked():
    added = (
        "+stages.watch={_target_: pipeline.stages.early_stop.EarlyStop, monitor: val/lss, mode: min, "
        "patience: 2, min_delta: 0.0, order: 50}"
    )
    with pytest.raises(
        ConfigError, match=r"stages.watch.monitor=val/lss: .*did you mean val/loss\?"
    ):
        check_monitors(config_of(*KERNODECK, added))


@pytest.mark.parametrize("overrides", [TINY, (*TINY, "trainer.grad_clip=0.5"), KERNODECK])
def test_the_declared_names_are_exactly_what_a_run_measures(tmp_path, overrides):
    """The declaration cannot drift from the code: a real run's step records hold every declared name, no other."""
    config = config_of(
        *overrides, "trainer.max_steps=4", "trainer.eval_every=2", f"paths.output_dir={tmp_path}"
    )
    job = assemble(config, identity.identify(config))
    seen: set[str] = set()
    fit(job.state, 2, lambda record: seen.update(metrics_of(record)) and False, [])
    assert sorted(seen) == metric_names(config)


def test_a_correct_non_default_monitor_is_accepted(tmp_path):
    out = tmp_path / "out"
    code, _ = run_job(
        *TINY,
        "stages.best_val.monitor=val/ppl",
        "+stages/early_stop=default",
        "stages.early_stop.monitor=train/loss",
        "stages.early_stop.patience=100",
        "optimized_metric=val/ppl",
        f"paths.output_dir={out}",
    )
    assert code == 0
    assert (the_run(out) / "checkpoints" / "best").is_symlink()


@pytest.mark.parametrize(
    "refused, said",
    [
        ("stages.best_val.monitor=val/los", "did you mean val/loss"),
        ("model=mlp", "pair model=minigpt"),
    ],
    ids=["monitor", "pairing"],
)
def test_a_refused_job_is_refused_before_its_tracker_prepares(tmp_path, monkeypatch, refused, said):
    """The monitors and the model/data pairing are checked before the tracker prepares (which makes the output
    directory and its store): a refused job with tracking on leaves nothing on disk either."""
    from pipeline.run.job import build
    from pipeline.run.tracker import Tracker

    prepared = []
    monkeypatch.setattr(Tracker, "prepare", lambda self: prepared.append(1))
    with pytest.raises(ConfigError, match=said):
        build(config_of(refused, "tracking=none", f"paths.output_dir={tmp_path / 'out'}"))
    assert prepared == []
    build(config_of(*KERNODECK, f"paths.output_dir={tmp_path / 'out'}"))
    assert prepared == [1]  # the same build of a good config does prepare it
