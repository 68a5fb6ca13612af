"""Schemas (pipeline/config/schemas.py): types only, values in YAML; every value checked before anything starts."""

from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields

import pytest
from conftest import KERNODECK, TINY, config_of
from omegaconf import MISSING

from pipeline.config.errors import ConfigError
from pipeline.config.schemas import SCHEMAS, Config, validate


def all_schemas():
    seen, todo = [], [Config, *SCHEMAS.values()]
    while todo:
        s = todo.pop()
        if s not in seen:
            seen.append(s)
            todo += [f.default_factory for f in fields(s) if f.default_factory is not NO_DEFAULT]
    return seen


def test_schemas_hold_types_and_the_yaml_holds_every_value():
    """Regression (#10.5): 8 schema defaults disagreed with the YAML (trainer.max_steps 0 vs 2000, ...)."""
    for schema in all_schemas():
        for f in fields(schema):
            if f.default_factory is NO_DEFAULT:  # a nested schema is a type, not a value
                assert f.default in (MISSING, None), (
                    f"{schema.__name__}.{f.name} has a value: {f.default!r}"
                )


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.batch_size=0", "trainer.batch_size=0: must be a number >= 1"),
        ("trainer.batch_size=-2", "trainer.batch_size=-2"),
        ("trainer.seed=-1", "trainer.seed=-1"),
        ("optimizer.lr=-0.1", "optimizer.lr=-0.1: must be a finite number > 0"),
        ("optimizer.lr=0", "optimizer.lr=0"),
        ("optimizer.betas=[0.9,1.0]", "optimizer.betas=[0.9, 1.0]: must be two numbers in [0, 1)"),
        ("optimizer.eps=0", "optimizer.eps"),
        ("model.hidden=[0]", "model.hidden=[0]: must be a list of layer widths >= 1"),
        ("model.dropout=1.0", "model.dropout=1.0: must be in [0, 1)"),
        ("scheduler.step_size=0", "scheduler.step_size=0"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5"),
        ("stages.rotate_last_3.keep=0", "stages.rotate_last_3.keep=0"),
        ("checkpoint.every_steps=-1", "checkpoint.every_steps=-1"),
        ("verify.cut=0", "verify.cut=0"),
        ("trainer.accumulate=0", "trainer.accumulate=0: must be a number >= 1"),
        ("trainer.grad_clip=-1", "trainer.grad_clip=-1.0: must be a number >= 0"),
        ("trainer.grad_clip=nan", "trainer.grad_clip=nan"),
        ("trainer.shards=0", "trainer.shards=0: must be a number >= 1"),
        ("trainer.threads=0", "trainer.threads=0: must be null or a number >= 1"),
    ],
    ids=lambda x: x if "=" in x and ":" not in x else "",
)
def test_a_bad_value_is_one_line_naming_the_key_value_and_range(override, words, tmp_path):
    with pytest.raises(ConfigError) as info:
        validate(config_of(*KERNODECK, override, f"paths.output_dir={tmp_path}"))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_an_integer_past_a_floats_range_is_checked_not_a_crash(tmp_path):
    huge = "9" * 400
    with pytest.raises(ConfigError, match=r"trainer\.batch_size=-9+: must be a number >= 1"):
        validate(
            config_of(*KERNODECK, f"trainer.batch_size=-{huge}", f"paths.output_dir={tmp_path}")
        )
    validate(config_of(*KERNODECK, f"trainer.max_steps={huge}", f"paths.output_dir={tmp_path}"))


def test_no_training_at_all_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.max_steps=0 and trainer.epochs=0"):
        validate(
            config_of(
                *KERNODECK,
                "trainer.max_steps=0",
                "trainer.epochs=0",
                f"paths.output_dir={tmp_path}",
            )
        )


def test_minigpt_cross_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"model.n_embd=16 is not divisible by model.n_head=3"):
        validate(config_of(*TINY, "model.n_head=3", f"paths.output_dir={tmp_path}"))


# The checks the constructors trust (each once, here): a model, a stage or the trainer built from a config
# that passed validate() does not check these again.
@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            (*TINY, "model.n_embd=10", "model.n_head=4"),
            "model.n_embd=10 is not divisible by model.n_head=4",
        ),
        (
            (*TINY, "trainer.dtype=float16"),
            "trainer.dtype=float16",
        ),  # the typed schema, while composing
        ((*TINY, "model.dropout=1.0"), "model.dropout=1.0: must be in [0, 1)"),
        ((*TINY, "model.attn_dropout=-0.1"), "model.attn_dropout=-0.1: must be in [0, 1)"),
        ((*KERNODECK, "model.activation=sigmoid"), "model.activation=sigmoid"),
        ((*KERNODECK, "stages.best_val.keep=0"), "stages.best_val.keep=0: must be a number >= 1"),
        ((*KERNODECK, "stages.best_val.mode=mid"), "stages.best_val.mode=mid"),
        ((*KERNODECK, "+stages.best_val.filename='{step'"), "stages.best_val.filename"),
        (
            (*KERNODECK, "stages.train.eval_every=-1"),
            "stages.train.eval_every=-1: must be a number >= 0",
        ),
        (
            (*KERNODECK, "+stages/early_stop=default", "stages.early_stop.patience=0"),
            "stages.early_stop.patience=0: must be a number >= 1",
        ),
        (
            (*KERNODECK, "+stages/early_stop=default", "stages.early_stop.min_delta=-1"),
            "stages.early_stop.min_delta=-1.0: must be a number >= 0",
        ),
        (
            (*KERNODECK, "+stages/early_stop=default", "stages.early_stop.min_delta=inf"),
            "stages.early_stop.min_delta",
        ),
        ((*KERNODECK, "trainer.shards=0"), "trainer.shards=0: must be a number >= 1"),
        ((*KERNODECK, "trainer.shards=2.5"), "trainer.shards=2.5"),
        ((*KERNODECK, "trainer.shards=true"), "trainer.shards=true"),
        ((*KERNODECK, "trainer.threads=0"), "trainer.threads=0: must be null or a number >= 1"),
        ((*KERNODECK, "data=grammar"), "pair model=minigpt with data=grammar"),
    ],
)
def test_each_value_check_the_constructors_trust_refuses_before_anything_is_built(
    overrides, words, tmp_path
):
    from hydra.errors import ConfigCompositionException

    from pipeline.run.assemble import check_pairing

    with pytest.raises((ConfigError, ConfigCompositionException)) as info:
        config = config_of(*overrides, f"paths.output_dir={tmp_path}")
        validate(config)
        check_pairing(config)  # the model against the data: run/assemble.py, the one place
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_every_shipped_combination_validates(tmp_path):
    for overrides in (
        (),
        KERNODECK,
        TINY,
        ("optimizer=sgd",),
        ("scheduler=step",),
        ("scheduler=constant",),
        ("resume=never",),
        ("tracking=server",),
        ("checkpoint=every_n_steps",),
    ):
        validate(config_of(*overrides, f"paths.output_dir={tmp_path}"))


def test_a_stage_added_by_override_without_a_key_of_its_class_is_one_line_naming_it(tmp_path):
    """Its node is not typed while composing (stages: Any), and its class has no defaults to fill the gap."""
    with pytest.raises(ConfigError) as info:
        validate(
            config_of(
                *KERNODECK,
                "+stages.x={_target_:pipeline.stages.best.BestVal,order:35}",
                f"paths.output_dir={tmp_path}",
            )
        )
    assert (
        str(info.value)
        == "stages.x: no monitor, mode (a pipeline.stages.best.BestVal stage takes _target_, "
        "monitor, mode, order, keep, filename)"
    )


def test_a_key_added_with_plus_that_no_schema_has_is_refused_with_the_nearest(tmp_path):
    """`+trainer.max_stpes=3` passes Hydra (a `+` adds what the node lacks): the schema names the typo."""
    with pytest.raises(
        ConfigError, match=r"trainer.max_stpes: no such key; did you mean trainer.max_steps\?"
    ):
        validate(config_of(*KERNODECK, "+trainer.max_stpes=3", f"paths.output_dir={tmp_path}"))
    with pytest.raises(ConfigError, match=r"optimizer.zzz: no such key$"):
        validate(config_of(*KERNODECK, "+optimizer.zzz=1", f"paths.output_dir={tmp_path}"))
