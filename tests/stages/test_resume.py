"""The resume stage's pure parts (pipeline/stages/resume.py, drift.py): a history's identity, the drift
between a checkpoint's run and a job, and which of it may resume; the runs themselves are in tests/run."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from pipeline.config.identity import lineage_of
from pipeline.run.plan import DriftError, allowed, drift, refuse


def job(lr=0.05, data="d2", **config):
    return SimpleNamespace(
        config={"optimizer": {"lr": lr}, "paths": {"output_dir": "b"}, **config},
        sources={},
        facts={"data_manifest_hash": data},
    )


MANIFEST = {
    "config": {"optimizer": {"lr": 0.03}, "paths": {"output_dir": "a"}},
    "sources": {},
    "data_manifest_hash": "d1",
}


def test_a_lineage_id_is_the_sha256_of_the_config_hash_and_origin():
    origin = {"checkpoint": "/r/checkpoints/step-00000018", "step": 18, "weights_sha256": "ab" * 32}
    for where in (None, origin):
        oracle = hashlib.sha256(
            json.dumps(
                {"semantic_config_hash": "h", "origin": where},
                sort_keys=True,
                separators=(",", ":"),
            ).encode()
        ).hexdigest()
        assert lineage_of("h", where) == {"id": oracle, "origin": where}
    assert lineage_of("h", None)["id"] != lineage_of("h2", None)["id"]


def test_drift_is_every_semantic_key_and_the_data_that_differ():
    assert drift(MANIFEST, job()) == {
        "optimizer.lr": (0.03, 0.05),
        "data_manifest_hash": ("d1", "d2"),
    }
    assert drift(MANIFEST, job(lr=0.03, data="d1")) == {}  # paths.* is not the run's identity
    assert drift(MANIFEST, job(lr=0.03, data="d1", model={"dropout": 0.1})) == {
        "model.dropout": ("<absent>", 0.1)
    }


@pytest.mark.parametrize(
    "key, allow, ok",
    [
        ("optimizer.lr", ["optimizer.lr"], True),
        ("optimizer.lr", ["optimizer"], True),
        ("optimizer.lr", ["optimizer.l"], False),
        ("data_manifest_hash", ["data.noise"], True),  # the data follows from its config
        ("data_manifest_hash", ["data"], True),
        ("data_manifest_hash", ["data_manifest_hash"], True),
        ("data_manifest_hash", ["optimizer.lr"], False),
        ("data.noise", ["data_manifest_hash"], False),
    ],
)
def test_which_changes_an_allowance_covers(key, allow, ok):
    assert allowed(key, allow) is ok


def test_refused_drift_names_each_refused_change_and_the_allowance_in_one_line():
    changes = {
        "optimizer.lr": (0.03, 0.05),
        "model.dropout": (0.25, 0.1),
        "trainer.max_steps": (10, 12),
    }
    with pytest.raises(DriftError) as info:
        refuse(changes, ["trainer.max_steps"], "/r/checkpoints/step-00000010")
    assert str(info.value) == (
        "refusing to resume from /r/checkpoints/step-00000010: the config or data changed (optimizer.lr: 0.03 -> "
        "0.05; model.dropout: 0.25 -> 0.1); allow with resume.allow_changes=[optimizer.lr,model.dropout] or start "
        "over with resume=never"
    )
    refuse(
        changes, ["optimizer", "model", "trainer.max_steps"], "here"
    )  # all allowed, all can apply


def test_an_allowed_change_that_cannot_take_effect_is_refused():
    with pytest.raises(
        DriftError,
        match=r"^refusing to resume from here: resume.allow_changes lets trainer.seed "
        r"through, but it cannot take effect on a resumed run \(the RNG streams",
    ):
        refuse({"trainer.seed": (42, 7)}, ["trainer"], "here")
