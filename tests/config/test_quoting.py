"""An override value quoted for Hydra (pipeline/config/targets.py `hydra_quoted`, `literal`) comes back as exactly
itself: from Hydra's own parser, as `hydra.searchpath`'s entries are used, and from the composed config, which
omegaconf resolves, as `hydra.sweep.dir` is used."""

from __future__ import annotations

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from pipeline.config import targets
from pipeline.config.compose import CONFIG_DIR, compose
from pipeline.config.targets import hydra_quoted, literal

AWKWARD = [
    "/a b",
    "/it's",
    'a"b',
    "/x'\"y",
    "c:\\x\\",
    "a\\'b",
    "a\\\\",
    "\\",
    "x,y]z[",
    "[a,b]",
    "{a: 1}",
    "a=b",
    "/plain/dir-1.2",
    "${x}",
    "/d/${x}/e",
    "a\\${x}",
    "a\\\\${x}\\",
    'it\'s "${x}", \\',
    " padded ",
    "",
    "true",
    "null",
    "1.5",
    "/tmp/résumé",
    "/données/x-1",
    "naïve",
]  # Hydra's lexer takes only ASCII unquoted


@pytest.mark.parametrize("value", AWKWARD)
def test_hydras_parser_reads_a_quoted_value_back_as_itself(value):
    alone, listed = OverridesParser.create().parse_overrides(
        [f"k={hydra_quoted(value)}", f"hydra.searchpath=[{hydra_quoted(value)},pkg://m.conf]"]
    )
    assert alone.value() == value and listed.value() == [value, "pkg://m.conf"]


@pytest.mark.parametrize("value", AWKWARD)
def test_a_quoted_literal_is_read_back_as_itself_from_the_resolved_config(value):
    """`x` is a key of the config, so a `${x}` read as an interpolation gives another value, not an error."""
    (override,) = OverridesParser.create().parse_overrides([f"k={hydra_quoted(literal(value))}"])
    assert OmegaConf.create({"x": "X", "k": override.value()}).k == value


def test_hydra_finds_a_config_directory_and_names_a_sweep_directory_with_any_name(tmp_path):
    """Hydra's composition itself: the search path's directory is found (its model option and the target it
    names), and the sweep directory read back from the composed config is the path given."""
    awkward = tmp_path / 'it\'s "${x}" a\\${y} [1,2], \\'
    (awkward / "model").mkdir(parents=True)
    (awkward / "model" / "mine.yaml").write_text((CONFIG_DIR / "model" / "mlp.yaml").read_text())
    (awkward / "extra.yaml").write_text("thing:\n  _target_: my.Thing\n")
    searchpath = f"hydra.searchpath=[{hydra_quoted(f'file://{awkward}')}]"
    cfg = compose(
        [searchpath, "model=mine", f"hydra.sweep.dir={hydra_quoted(literal(str(awkward)))}"],
        return_hydra_config=True,
    )
    assert cfg.hydra.sweep.dir == str(awkward)
    assert cfg.model._target_ == compose(["model=mlp"]).model._target_
    assert "my.Thing" in targets.allowed((searchpath,))
