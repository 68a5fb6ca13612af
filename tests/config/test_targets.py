"""Our own package is no blank cheque (pipeline/config/targets.py): a checkpoint whose config names, at any node, a
`pipeline.*` class or function that the shipped conf/ does not build at that node -- one that exists but no config
names (`pipeline.model.layers.embedding_forward` as the model), one that does not exist (`pipeline.model.mlp.Nope`),
one of another package (a tracking function as a stage), or a shipped class of the right package in another slot (a
stage as the checkpoint cadence, the cadence as a stage, the sweep callback as the tracker) -- is refused in one
line naming the key and the target, by the allow-list itself and by a tool's real `main`, before anything is
imported or built. An allow-list that took any `pipeline.*` target in its package's place fails these tests."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from conftest import KERNODECK, the_run

from pipeline.config import targets
from pipeline.config.identity import config_hash, semantic_hash

UNSHIPPED = "which neither the pipeline's configs nor yours name"
OUT_OF_SLOT = "a class the pipeline builds only under"
EITHER = (UNSHIPPED, OUT_OF_SLOT)  # unshipped and out of its package's place: refused as either

# node -> (a pipeline target conf/ does not build there, the refusal's words)
CASES = [
    ("model", "pipeline.model.layers.embedding_forward", UNSHIPPED),
    ("model", "pipeline.model.mlp.Nope", UNSHIPPED),
    ("model", "pipeline.model.base.Model", UNSHIPPED),
    ("model", "pipeline.data.regression.Regression", OUT_OF_SLOT),
    ("data", "pipeline.data.corpus.canonical_json", UNSHIPPED),
    ("data", "pipeline.data.iterator.DataIterator", UNSHIPPED),
    ("data", "pipeline.model.mlp.MLP", OUT_OF_SLOT),
    ("optimizer", "pipeline.optimizer.base.Optimizer", UNSHIPPED),
    ("optimizer", "pipeline.optimizer.sgd.Nope", UNSHIPPED),
    ("optimizer", "pipeline.scheduler.constant.Constant", OUT_OF_SLOT),
    ("scheduler", "pipeline.scheduler.base.Scheduler", UNSHIPPED),
    ("scheduler", "pipeline.optimizer.adam.Adam", OUT_OF_SLOT),
    ("tracking", "pipeline.tracking.common.normalize_tracking_uri", UNSHIPPED),
    ("tracking", "pipeline.sweep.callback.SweepCallback", OUT_OF_SLOT),
    ("checkpoint", "pipeline.stages.rotate.RotateLastN", OUT_OF_SLOT),
    ("checkpoint", "pipeline.stages.cadence.Nope", UNSHIPPED),
    ("stages.rotate_last_3.cadence", "pipeline.stages.final.Final", OUT_OF_SLOT),
    ("stages.rotate_last_3.cadence", "pipeline.stages.drift.drift", UNSHIPPED),
    *(
        (f"stages.{stage}", target, words)
        for stage in ("resume", "train", "rotate_last_3", "best_val", "final", "early_stop")
        for target, words in (
            ("pipeline.tracking.common.sqlite_path", EITHER),
            ("pipeline.stages.drift.refuse", UNSHIPPED),
            ("pipeline.stages.base.Stage", UNSHIPPED),
            ("pipeline.stages.cadence.Cadence", OUT_OF_SLOT),
        )
    ),
    (
        "stages.best_val.extra",
        "pipeline.stages.best.BestVal",
        OUT_OF_SLOT,
    ),  # nested: conf/ builds none there
]
IDS = [f"{k}={t}" for k, t, _ in CASES]


# conftest's `finished`: a tiny kernodeck run with every node a config has: a cadence in its stage, early stopping
FINISHED = (
    *KERNODECK,
    "trainer.max_steps=4",
    "+stages/early_stop=default",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=2",
)


def _manifest(finished: Path) -> dict:
    return json.loads((the_run(finished) / "checkpoints" / "final" / "manifest.json").read_text())


def _put(config: dict, key: str, target: str) -> dict:
    """config with the node at `key` made to name `target` (its other keys kept; a new node for a new key)."""
    config = copy.deepcopy(config)
    *parents, leaf = key.split(".")
    parent = config
    for p in parents:
        parent = parent[p]
    parent[leaf] = {**(parent.get(leaf) or {}), "_target_": target}
    return config


def test_the_run_has_every_node(finished):
    config = _manifest(finished)["config"]
    for key, _, _ in CASES:
        node = config
        for p in key.split(".")[:-1]:
            node = node[p]
        assert key.endswith(".extra") or "_target_" in node[key.split(".")[-1]], key
    targets.check(config, targets.allowed(()))  # as saved, it passes


def test_every_shipped_pipeline_class_has_its_slots():
    slots = targets.slots()
    assert set(slots) == targets.shipped()
    assert slots["pipeline.stages.cadence.Cadence"] == {"checkpoint"}
    assert slots["pipeline.stages.final.Final"] == {"stages.<name>"}
    assert slots["pipeline.sweep.callback.SweepCallback"] == {"hydra.callbacks.<name>"}


@pytest.mark.parametrize("key, target, words", CASES, ids=IDS)
def test_the_allow_list_refuses_it(finished, key, target, words):
    config = _put(_manifest(finished)["config"], key, target)
    with pytest.raises(targets.UnknownTarget) as e:
        targets.check(config, targets.allowed(()))
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        tuple(
            f"config.{key}._target_ names '{target}', {w}"
            for w in (words if isinstance(words, tuple) else (words,))
        )
    ), line


@pytest.mark.parametrize("key, target, words", CASES, ids=IDS)
def test_a_tool_refuses_it_in_one_line(finished, tmp_path, key, target, words, capsys):
    """show's own main on a checkpoint whose hashes were recomputed: exit 2, one line naming key and target."""
    from pipeline.cli import show

    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    ckpt = the_run(out) / "checkpoints" / "final"
    m = json.loads((ckpt / "manifest.json").read_text())
    m["config"] = _put(m["config"], key, target)
    m["config_hash"] = config_hash(m["config"])
    m["semantic_config_hash"] = semantic_hash(m["config"], m["sources"])
    (ckpt / "manifest.json").write_text(json.dumps(m))
    assert show.main([str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert any(
        f"config.{key}._target_ names '{target}', {w}" in captured.err
        for w in (words if isinstance(words, tuple) else (words,))
    )


def test_your_own_config_may_still_name_an_unshipped_class_of_ours_in_its_package(tmp_path):
    """The user's choice (a search path on the command line), not the checkpoint's."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: pipeline.model.base.Model\n")
    allowed = targets.allowed((f"hydra.searchpath=[file://{tmp_path}]",))
    targets.check({"model": {"_target_": "pipeline.model.base.Model"}}, allowed)
    with pytest.raises(targets.UnknownTarget, match="never under stages"):
        targets.check({"stages": {"x": {"_target_": "pipeline.model.base.Model"}}}, allowed)
