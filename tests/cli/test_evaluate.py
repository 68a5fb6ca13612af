"""`python -m pipeline.evaluate` (pipeline/cli/evaluate.py, pipeline/run/trained.py): on its own data a checkpoint's
metrics are exactly what its run measured at that step; on another dataset they are the mean token
cross-entropy computed here independently; data the model cannot read, and checkpoints that do not verify,
are refused in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    KERNODECK,
    TINY,
    refused_in_one_line,
    run_job,
    run_pipeline,
    text_overrides,
    the_run,
)

from pipeline.cli.evaluate import evaluate_checkpoint
from pipeline.files import jsonio
from pipeline.run.directory import RunDir

VAL = ("val/loss", "val/ppl", "val/ngram_baseline_ppl")


def trained(out: Path, *overrides: str) -> Path:
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
    return RunDir(the_run(out)).store.root


@pytest.fixture(scope="module")
def tiny(finished_job) -> Path:
    return RunDir(the_run(finished_job(*TINY))).store.root


def manifest(ckpt: Path) -> dict:
    return jsonio.read(ckpt / "manifest.json", 1 << 24)


@pytest.mark.parametrize("link", ["final", "best"])
def test_on_its_own_data_the_metrics_are_those_its_run_measured(tiny, finished_job, link):
    m = manifest(tiny / link)
    result = evaluate_checkpoint(tiny / link)
    assert result["own_data"] and result["step"] == m["step"]
    assert result["metrics"] == {
        k: m["metrics"][k] for k in VAL
    }  # exact: the same state, the same function
    kernodeck = RunDir(the_run(finished_job(*KERNODECK))).store.root / link
    assert evaluate_checkpoint(kernodeck)["metrics"] == {
        "val/loss": manifest(kernodeck)["metrics"]["val/loss"]
    }


def test_the_command_prints_one_line_or_json(tiny, tmp_path):
    m = manifest(tiny / "final")
    proc = run_pipeline([str(tiny / "final")], tmp_path / "cwd", module="pipeline.evaluate")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    fields = dict(kv.split("=") for kv in line.split())
    assert fields["step"] == "12" and set(fields) == {"step", *VAL}
    assert float(fields["val/loss"]) == pytest.approx(
        m["metrics"]["val/loss"], rel=1e-5
    )  # printed with 6 digits
    proc = run_pipeline(
        [str(tiny / "final"), "--json"], tmp_path / "cwd", module="pipeline.evaluate"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["metrics"] == {k: m["metrics"][k] for k in VAL} and result["own_data"] is True


def mean_token_cross_entropy(ckpt: Path, dataset) -> float:
    """The model rebuilt from weights.safetensors alone, scored on every validation token in float64."""
    from safetensors.numpy import load_file

    from pipeline.model.minigpt import MiniGPT

    config = manifest(ckpt)["config"]["model"]
    model = MiniGPT(
        dataset.spec,
        **{k: v for k, v in config.items() if k != "_target_"},
        dtype="float32",
        rng=np.random.default_rng(0),
    )
    weights = load_file(str(ckpt / "weights.safetensors"))
    for name, p in model.params.items():
        np.copyto(p, weights[name])
    total, count = 0.0, 0
    for batch in dataset.val_batches():
        z = model.logits(batch.x).astype(np.float64)  # [B, T, V]
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= np.take_along_axis(logp, batch.y[..., None], -1).sum()
        count += batch.y.size
    return total / count


def test_on_another_dataset_with_the_same_vocabulary(tiny):
    from pipeline.run.assemble import build_dataset

    result = evaluate_checkpoint(tiny / "final", ["data.seed=99"])
    assert not result["own_data"]
    config = manifest(tiny / "final")["config"]
    other = build_dataset({"paths": config["paths"], "data": {**config["data"], "seed": 99}})
    assert result["data_manifest_hash"] == other.manifest_hash
    assert result["metrics"]["val/loss"] == pytest.approx(
        mean_token_cross_entropy(tiny / "final", other), rel=1e-5
    )
    assert result["metrics"]["val/loss"] != manifest(tiny / "final")["metrics"]["val/loss"]
    # data=NAME composes another dataset like `python -m pipeline`; here the same one again
    again = evaluate_checkpoint(
        tiny / "final",
        [
            "data=grammar",
            "data.seed=99",
            "data.n_sentences=400",
            "data.block_size=16",
            "data.val_batch_size=16",
        ],
    )
    assert again["metrics"] == result["metrics"]


def refused(args: list[str], cwd: Path) -> str:
    return refused_in_one_line(args, cwd, module="pipeline.evaluate")


def test_data_the_model_cannot_read_is_refused_naming_the_difference(tiny, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abc de\n" * 100)
    err = refused([str(tiny / "final"), "data=text", f"data.path={text}"], tmp_path / "cwd")
    assert "spec differs" in err and "vocab_size 250 -> 7" in err and "block_size 16 -> 64" in err
    err = refused([str(tiny / "final"), "data.block_size=32"], tmp_path / "cwd")
    assert "block_size 16 -> 32" in err


def test_a_text_vocabulary_that_differs_is_refused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abc de\n" * 100)
    b.write_text("xyz uv\n" * 100)  # as many distinct characters, other ones
    ckpt = trained(tmp_path / "out", *text_overrides(a)) / "final"
    assert evaluate_checkpoint(ckpt, [f"data.path={a}"])["own_data"]
    err = refused([str(ckpt), f"data.path={b}"], tmp_path / "cwd")
    assert "vocabulary differs from the checkpoint's at 5 ids (id 2: 'a' -> 'u')" in err


def test_a_checkpoint_that_does_not_verify_and_foreign_overrides_are_refused(tiny, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny / "final", damaged)
    data = bytearray((damaged / "weights.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / "weights.safetensors").write_bytes(bytes(data))
    assert "weights.safetensors: sha256 differs from manifest.json" in refused(
        [str(damaged)], tmp_path / "cwd"
    )
    assert "manifest.json: missing" in refused([str(tmp_path)], tmp_path / "cwd")
    assert "model.n_layer=2: only data=NAME" in refused(
        [str(tiny / "final"), "model.n_layer=2"], tmp_path / "cwd"
    )
    assert "data.seed" in refused([str(tiny / "final"), "data.seed=abc"], tmp_path / "cwd")


def test_data_of_another_kind_is_refused_before_the_model_is_built(tiny, tmp_path):
    """A minigpt checkpoint on rows of features: the data's spec against the checkpoint's, in one line (the
    model's constructor trusts its data, as it trusts its values)."""
    err = refused([str(tiny / "final"), "data=regression"], tmp_path / "cwd")
    assert "data Regression: its spec differs" in err and "vocab_size 250 -> 0" in err, err


def test_a_checkpoint_whose_data_has_no_vocabulary_is_checked_by_its_spec_alone(tiny, monkeypatch):
    # data.json of data without a vocabulary says "vocab": null; other data with one is then checked by spec only
    import pipeline.run.trained as trained

    facts = trained.data_facts
    monkeypatch.setattr(trained, "data_facts", lambda *a: {**facts(*a), "vocab": None})
    result = evaluate_checkpoint(tiny / "final", ["data.seed=99"])
    assert not result["own_data"] and "val/loss" in result["metrics"]
