"""The live-argument interface (config/schemas.py LIVE, docs/own-model.md): which live values each kind of part is
given; a class of your own that lacks one its kind needs is refused in one line before anything starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import KERNODECK, refused_in_one_line
from hydra.utils import get_class

from pipeline.config import schemas, targets
from pipeline.config.errors import ConfigError
from pipeline.data.base import DataSpec
from pipeline.run.assemble import _call


class NoRng:
    """A model of your own that spells the init stream `rnd`: it would train from an RNG no checkpoint saves."""

    needs = "rows"

    def __init__(self, spec, width: int, dtype: str, rnd=None):
        self.width = width


class TakesAll:
    needs = "rows"

    def __init__(self, width: int, **live):
        self.width, self.live = width, live


def test_every_shipped_part_takes_the_live_values_of_its_kind():
    built = {t: s for t, s in targets.slots().items() if s & set(schemas.LIVE)}
    assert {s for slots in built.values() for s in slots} == set(schemas.LIVE)
    for target, slots in built.items():
        for kind in slots:
            assert schemas.live_problem(kind, target, get_class(target)) is None, target


def test_a_model_without_rng_is_refused_naming_the_interface():
    config = {"model": {"_target_": f"{__name__}.NoRng", "width": 2}}
    with pytest.raises(ConfigError) as e:
        schemas.validate(config)
    assert str(e.value) == (
        f"model._target_={__name__}.NoRng takes no 'rng': every model is given spec, dtype, rng "
        "(the live-argument interface, docs/own-model.md); add it to its constructor (or **kwargs)"
    )
    live = dict(spec=DataSpec(2, 1, None, None), dtype="float32", rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="takes no 'rng'"):  # however it is reached
        _call(config["model"], **live)
    built = _call({"_target_": f"{__name__}.TakesAll", "width": 3}, **live)
    assert built.width == 3 and built.live == live  # **kwargs takes every live value


def test_an_optional_live_value_is_given_only_to_a_class_that_takes_it():
    data = _call({"_target_": "pipeline.data.regression.Regression", **REGRESSION}, cache_dir="x")
    assert data.spec.n_features == 2  # Regression keeps nothing on disk: no cache_dir, no refusal


REGRESSION = dict(n_rows=64, seed=0, noise=0.1, input_gain=1.0, input_noise=0.0)


def test_the_job_refuses_it_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}:{Path(__file__).parents[1]}")
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "norng.yaml").write_text(f"_target_: {__name__}.NoRng\nwidth: 4\n")
    out = tmp_path / "out"
    line = refused_in_one_line(
        [
            *KERNODECK,
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "model=norng",
            f"paths.output_dir={out}",
        ],
        tmp_path / "cwd",
    )
    assert "takes no 'rng': every model is given spec, dtype, rng" in line, line
    assert not out.exists()
