"""A checkpoint stands alone for inference (pipeline/checkpoint/store.py data.json, pipeline/run/trained.py):
its vocabulary, decode join and special tokens travel in data.json, listed and hashed like every file, so
with the corpus (and a text run's source file) deleted it still samples and exports the same, and evaluates
on data regenerated from its config; a damaged, unlisted or missing data.json is refused naming it."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import (
    TINY,
    refused_in_one_line,
    relist,
    run_job,
    run_pipeline,
    text_overrides,
    the_run,
)

from pipeline.checkpoint.directory import DATA, MANIFEST, CheckpointDir
from pipeline.checkpoint.errors import CheckpointError
from pipeline.cli.evaluate import evaluate_checkpoint
from pipeline.cli.sample import sample
from pipeline.config.errors import ConfigError
from pipeline.files import jsonio
from pipeline.run.directory import RunDir

NEEDS_TOKENIZERS = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="tokenizers is not installed (pip install 'pipeline[hf]')",
)
PROMPTS = {
    "grammar": ["prompt=the man", "max_new_tokens=20", "seed=5"],
    "text": ["prompt=Abc", "max_new_tokens=30"],
}


def export(ckpt: Path, out: Path) -> dict[str, bytes]:
    from pipeline.cli.export_hf import main

    main([str(ckpt), str(out)])
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def inference(ckpt: Path, which: str) -> dict:
    """What sampling gives from a checkpoint: sampled and greedy text."""
    return {
        "sample": sample(ckpt, PROMPTS[which]),
        "greedy": sample(ckpt, [*PROMPTS[which], "temperature=0"]),
    }


def trained(tmp: Path, which: str, finished_job) -> dict:
    """A tiny run's final checkpoint, what the tools gave from it, and then its corpus (and text file) deleted."""
    out = tmp / "out"
    if which == "grammar":
        source = None
        finished_job(*TINY, copy_to=out)  # a copy: its corpus is deleted below
    else:
        source = tmp / "a.txt"
        source.write_text("Abc dé,\nfg hé.\n" * 60)
        assert run_job(*text_overrides(source), f"paths.output_dir={out}")[0] == 0
    ckpt = RunDir(the_run(out)).store.root / "final"
    before = inference(ckpt, which)
    if (
        importlib.util.find_spec("tokenizers") is not None
    ):  # the export's own test skips, saying why, without it
        before["export"] = export(ckpt, tmp / "hf-before")
    metrics = evaluate_checkpoint(ckpt)["metrics"]
    kept = tmp / "kept.txt"
    if source is not None:
        shutil.copy(source, kept)
        source.unlink()
    shutil.rmtree(out / "data")
    return {
        "ckpt": ckpt,
        "out": out,
        "before": before,
        "metrics": metrics,
        "kept": kept,
        "tmp": tmp,
    }


@pytest.fixture(scope="module")
def grammar(tmp_path_factory, finished_job) -> dict:
    return trained(tmp_path_factory.mktemp("grammar"), "grammar", finished_job)


@pytest.fixture(scope="module")
def text(tmp_path_factory, finished_job) -> dict:
    return trained(tmp_path_factory.mktemp("text"), "text", finished_job)


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    """A copy of a checkpoint in a run layout of its own, for a test to damage."""
    directory = tmp_path / "runs" / "r" / "checkpoints" / CheckpointDir(ckpt).resolved().name
    shutil.copytree(CheckpointDir(ckpt).resolved(), directory)
    return directory


@pytest.mark.parametrize("which", ["grammar", "text"])
def test_without_its_corpus_a_checkpoint_samples_the_same(which, grammar, text):
    run = grammar if which == "grammar" else text
    assert not (run["out"] / "data").exists()
    assert inference(run["ckpt"], which) == {k: run["before"][k] for k in ("sample", "greedy")}
    assert not (run["out"] / "data").exists()  # nothing was regenerated to find the vocabulary


@NEEDS_TOKENIZERS
@pytest.mark.parametrize("which", ["grammar", "text"])
def test_without_its_corpus_a_checkpoint_exports_the_same(which, grammar, text, tmp_path):
    run = grammar if which == "grammar" else text
    got = export(run["ckpt"], tmp_path / "hf")
    assert got == run["before"]["export"] and "tokenizer.json" in got, sorted(got)
    proc = run_pipeline(
        [str(run["ckpt"]), str(tmp_path / "cmd")], tmp_path, module="pipeline.export_hf"
    )
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "cmd").iterdir())} == got
    assert not (run["out"] / "data").exists()


def test_data_json_holds_the_corpus_vocabulary_join_and_specials(grammar, text):
    from pipeline.data.grammar import vocabulary

    assert CheckpointDir(grammar["ckpt"]).data_facts() == {
        "vocab": vocabulary(),
        "decode_join": " ",
        "specials": {"eos": "<eos>"},
    }
    chars = sorted(set(text["kept"].read_text()))
    assert CheckpointDir(text["ckpt"]).data_facts() == {
        "vocab": chars,
        "decode_join": "",
        "specials": {},
    }


def test_data_json_is_the_same_bytes_in_every_checkpoint_of_a_run(grammar):
    entries = {
        json.dumps(CheckpointDir(d).manifest()["files"][DATA])
        for _, d in RunDir(the_run(grammar["out"])).store.steps()
    }
    assert len(entries) == 1


def test_evaluate_regenerates_the_grammar_corpus_and_measures_the_same(grammar):
    result = evaluate_checkpoint(grammar["ckpt"])
    assert result["own_data"] and result["metrics"] == grammar["metrics"]
    assert (grammar["out"] / "data").is_dir()
    shutil.rmtree(grammar["out"] / "data")  # as the other tests expect it


def test_evaluate_reads_a_text_corpus_from_the_file_the_user_names(text, tmp_path):
    line = refused_in_one_line([str(text["ckpt"])], tmp_path, module="pipeline.evaluate")
    assert "text file not found" in line and "data.path=FILE" in line, line
    result = evaluate_checkpoint(text["ckpt"], [f"data.path={text['kept']}"])
    assert result["own_data"] and result["metrics"] == text["metrics"]
    shutil.rmtree(text["out"] / "data")


def test_another_dataset_is_checked_against_the_checkpoints_own_vocabulary(text, tmp_path):
    other = tmp_path / "b.txt"
    other.write_text(
        "Abc dx,\nfg hx.\n" * 60
    )  # x for é: the same size of vocabulary, its last token changed
    with pytest.raises(
        ConfigError,
        match=r"vocabulary differs from the checkpoint's at 1 ids \(id 11: 'é' -> 'x'\)",
    ):
        evaluate_checkpoint(text["ckpt"], [f"data.path={other}"])


def test_a_flipped_byte_in_data_json_is_refused_naming_it(grammar, tmp_path):
    ckpt = copy_of(grammar["ckpt"], tmp_path)
    raw = bytearray((ckpt / DATA).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (ckpt / DATA).write_bytes(bytes(raw))
    for reader in (CheckpointDir.load, CheckpointDir.data_facts):
        with pytest.raises(CheckpointError) as info:
            reader(CheckpointDir(ckpt))
        assert info.value.file == DATA and "corrupted" in info.value.reason
    line = refused_in_one_line([str(ckpt), "prompt=the"], tmp_path, module="pipeline.sample")
    assert f"{DATA}: sha256 differs" in line, line


@pytest.mark.parametrize(
    "damage", ["unlisted", "missing", "missing and unlisted", "a vocabulary of another size"]
)
def test_a_new_checkpoint_without_its_data_json_is_refused_naming_it(damage, grammar, tmp_path):
    ckpt = copy_of(grammar["ckpt"], tmp_path)
    if "missing" in damage:
        (ckpt / DATA).unlink()
    if "unlisted" in damage:
        relist(ckpt, drop=DATA)
    if "size" in damage:
        data = json.loads((ckpt / DATA).read_text())
        data["vocab"].pop()
        (ckpt / DATA).write_text(json.dumps(data))
        relist(ckpt, DATA)
    with pytest.raises(CheckpointError) as info:
        CheckpointDir(ckpt).load()
    e = info.value
    assert DATA in str(e) and "\n" not in str(e), e
    expected = {
        "unlisted": (MANIFEST, "does not list data.json"),
        "missing": (DATA, "listed in manifest.json but missing"),
        "missing and unlisted": (MANIFEST, "does not list data.json"),
        "a vocabulary of another size": (DATA, "data_spec says vocab_size"),
    }[damage]
    assert (e.file, expected[1] in e.reason) == (expected[0], True), e


def test_a_schema_2_0_checkpoint_without_data_json_builds_its_data_instead(grammar, tmp_path):
    ckpt = copy_of(grammar["ckpt"], tmp_path)
    (ckpt / DATA).unlink()
    relist(ckpt, drop=DATA, schema_version="2.0")
    assert CheckpointDir(ckpt).data_facts() is None and CheckpointDir(ckpt).load().data is None
    # its own corpus is built where the checkpoint lies (here tmp_path), as before data.json
    assert sample(ckpt, PROMPTS["grammar"]) == grammar["before"]["sample"]
    assert list((tmp_path / "data").iterdir())


@pytest.mark.slow
def test_the_commands_stand_alone(grammar, tmp_path):
    proc = run_pipeline(
        [str(grammar["ckpt"]), *PROMPTS["grammar"]], tmp_path, module="pipeline.sample"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == grammar["before"]["sample"], proc.stderr
    assert not (grammar["out"] / "data").exists()
    proc = run_pipeline([str(grammar["ckpt"]), "--json"], tmp_path, module="pipeline.evaluate")
    assert proc.returncode == 0, proc.stderr
    assert jsonio.loads(proc.stdout.encode())["metrics"] == grammar["metrics"]
    shutil.rmtree(grammar["out"] / "data")


@pytest.mark.parametrize(
    "plant, words",
    [
        (
            lambda d: d.__setitem__("decode_join", " " * (4 << 20)),
            "decode_join must be a string of at most 16",
        ),
        (
            lambda d: d["vocab"].__setitem__(3, "w" * 257),
            "a token of 257 characters: tokens are at most 256",
        ),
        (
            lambda d: d.__setitem__("specials", {f"role{i}": "<eos>" for i in range(17)}),
            "at most 16 roles",
        ),
    ],
)
def test_data_json_strings_are_bounded(plant, words, grammar, tmp_path):
    """A planted 4 MiB decode_join (hashes recomputed) would cost sample gigabytes: refused before it decodes."""
    ckpt = copy_of(grammar["ckpt"], tmp_path)
    data = json.loads((ckpt / DATA).read_text())
    plant(data)
    (ckpt / DATA).write_text(json.dumps(data))
    relist(ckpt, DATA)
    with pytest.raises(CheckpointError) as info:
        CheckpointDir(ckpt).data_facts()
    assert info.value.file == DATA and words in info.value.reason, info.value
    line = refused_in_one_line([str(ckpt), "prompt=the"], tmp_path, module="pipeline.sample")
    assert words in line, line
