"""Every default lives in one place, the YAML under conf/: a class built from config takes each of its node's
keys with no default of its own (one could disagree with the YAML unseen), and what an old config's missing or
null key means (`absent`) is said once, in its schema."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import yaml
from conftest import config_of
from hydra.utils import get_class

from pipeline.config.compose import CONFIG_DIR
from pipeline.config.schemas import SCHEMAS, validate


def option_files() -> list:
    """conf/<group>/<option>.yaml files that build a class (`_target_`), as (path, node)."""
    out = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        node = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(node, dict) and isinstance(node.get("_target_"), str):
            out.append((path.relative_to(CONFIG_DIR).as_posix(), node))
    return out


def keys(schema) -> list[str]:
    return [f.name for f in fields(schema) if f.name != "_target_"]


@pytest.mark.parametrize("target", sorted(SCHEMAS))
def test_a_class_built_from_config_has_no_default_for_any_key_of_its_node(target):
    """Regression (#20): MiniGPT(dropout=0.0, attn_dropout=None) against the YAML's 0.1 and 0.0, WarmupCosine's
    warmup_steps 0 against 100."""
    params = inspect.signature(get_class(target)).parameters
    for key in keys(SCHEMAS[target]):
        assert key in params, f"{target} takes no {key!r}, which its schema types"
        assert params[key].default is inspect.Parameter.empty, (
            f"{target}({key}={params[key].default!r}): a default beside the YAML's value"
        )


def test_every_shipped_option_is_typed_by_the_schema_of_its_target_and_gives_every_key():
    seen = set()
    for path, node in option_files():
        schema = SCHEMAS.get(node["_target_"])
        assert schema is not None, f"{path}: {node['_target_']} has no schema"
        seen.add(node["_target_"])
        given = set(node) - {"_target_", "defaults"}
        assert given == set(keys(schema)), (
            f"{path}: keys {sorted(given ^ set(keys(schema)))} differ from its schema"
        )
        if schema.stored_as is not None and "defaults" in node:
            assert node["defaults"][0] == f"/schema/{schema.stored_as}@_here_", path
    # stages (and the resume's and training's settings) live in conf/stages/default.yaml as one node each
    stage = {t for t in SCHEMAS if str(SCHEMAS[t].stored_as).startswith("stage/")}
    assert {t for t in SCHEMAS if t not in stage or t.endswith("EarlyStop")} <= seen


def test_the_stages_of_the_default_pipeline_give_every_key_of_their_schema():
    stages = yaml.safe_load((CONFIG_DIR / "stages" / "default.yaml").read_text(encoding="utf-8"))
    for name, node in stages.items():
        if name != "defaults":
            assert set(node) == {"_target_", *keys(SCHEMAS[node["_target_"]])}, name


TEXT = "pipeline.data.text.TextCorpus"


def test_data_max_bytes_is_the_yamls_number_and_null_is_refused_on_the_command_line():
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config.compose import compose, to_plain

    (text,) = [node for path, node in option_files() if path == "data/text.yaml"]
    assert isinstance(text["max_bytes"], int) and text["max_bytes"] >= 1
    assert to_plain(compose(["data=text", "data.path=x"]))["data"]["max_bytes"] == text["max_bytes"]
    with pytest.raises((HydraException, OmegaConfBaseException), match="max_bytes"):
        compose(["data=text", "data.path=x", "data.max_bytes=null"])


@pytest.mark.parametrize("written", [{"max_bytes": None}, {}], ids=["null", "before the key"])
def test_a_config_written_with_a_null_or_no_max_bytes_validates_and_means_32_mib(written, tmp_path):
    """A checkpoint's config from when data.max_bytes could be null (or did not exist) meant 32 MiB: it still
    validates, and a file over 32 MiB is refused by that bound, one under it is read (run/trained.py reads a
    checkpoint's data node as written now before it hashes its file)."""
    from pipeline.config.errors import ConfigError
    from pipeline.files import reading
    from pipeline.run.trained import data_config

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate((32 << 20) + 1)  # sparse: nothing written
    node = {
        "_target_": TEXT,
        "path": str(big),
        "val_fraction": 0.1,
        "block_size": 8,
        "ngram_order": 2,
        "val_batch_size": 4,
        **written,
    }
    validate({"data": node})
    manifest = {"config": {"data": node}, "sources": {"data.path": "0" * 64}}
    with pytest.raises(ConfigError, match=r"over the 33554432-byte limit set by data\.max_bytes"):
        data_config(manifest, [], tmp_path / "run" / "checkpoints" / "step-00000001")
    small = tmp_path / "small.txt"
    small.write_text("abc")
    manifest = {
        "config": {"data": {**node, "path": str(small)}},
        "sources": {"data.path": reading.sha256(small, 3)},
    }
    config = data_config(manifest, [], tmp_path / "run" / "checkpoints" / "step-00000001")
    assert config["data"]["max_bytes"] == 32 << 20


def test_a_file_named_by_a_node_that_gives_no_bound_is_refused_in_one_sentence():
    from pipeline.config import identity
    from pipeline.config.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"data\.path=f: names a file but data.max_bytes .* is not set"
    ):
        identity.source_hashes({"data": {"_target_": "my.own.Data", "path": "f"}})


def test_the_train_state_takes_every_trainer_key_it_holds_without_a_default():
    """Regression (#31): TrainState said shards=1 where conf/trainer/default.yaml says 2, unseen because the one
    caller passes them all; a field named like a trainer key has no default to disagree with the YAML."""
    from dataclasses import MISSING

    from pipeline.trainer.state import TrainState

    trainer = yaml.safe_load((CONFIG_DIR / "trainer" / "default.yaml").read_text(encoding="utf-8"))
    held = [f for f in fields(TrainState) if f.name in trainer]
    assert {f.name for f in held} >= {"accumulate", "grad_clip", "shards", "threads"}
    assert [
        f.name for f in held if f.default is not MISSING or f.default_factory is not MISSING
    ] == []


def test_the_nanogpt_recipe_is_nanogpts_cpu_command_line(tmp_path):
    # nanoGPT's train.py defaults, config/train_shakespeare_char.py and its README's CPU flags, key by key
    text = tmp_path / "input.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    c = config_of("experiment=nanogpt_char_cpu", f"data.path={text}")
    assert {
        k: c["model"][k] for k in ("n_layer", "n_head", "n_embd", "dropout", "bias", "gelu")
    } == {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, "bias": False, "gelu": "erf"}
    assert (
        c["model"]["init_std"] == 0.02
        and c["data"]["block_size"] == 64
        and c["data"]["val_fraction"] == 0.1
    )
    opt = c["optimizer"]
    assert (
        opt["_target_"].endswith("AdamW"),
        opt["lr"],
        opt["betas"],
        opt["weight_decay"],
        opt["weight_decay_on"],
    ) == (True, 1e-3, [0.9, 0.99], 0.1, "matrices")
    sch = c["scheduler"]
    assert (sch["warmup_steps"], sch["warmup_offset"]) == (100, 1)
    assert (
        sch["min_lr_ratio"] * opt["lr"] == pytest.approx(1e-4) and sch["total_steps"] is None
    )  # = max_iters
    t = c["trainer"]
    assert (
        t["max_steps"],
        t["batch_size"],
        t["accumulate"],
        t["grad_clip"],
        t["eval_every"],
        t["eval_batches"],
        t["dtype"],
    ) == (2000, 12, 1, 1.0, 250, 20, "float32")
    assert (
        c["data"]["val_batch_size"] == t["batch_size"]
    )  # estimate_loss reads batches of batch_size
    with pytest.raises(Exception, match=r"data\.path"):
        config_of("experiment=nanogpt_char_cpu")
