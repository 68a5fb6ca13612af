"""Corpora on disk: byte-identical regeneration, verified reuse, safe concurrent writers, and the windows."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ngram_fit, ngram_perplexity

from pipeline.data import corpus
from pipeline.data.grammar import GrammarCorpus, build_grammar_corpus
from pipeline.data.text import TextCorpus
from pipeline.files.atomic import TMP_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(n_sentences=1500, val_fraction=0.1, block_size=32, ngram_order=3, val_batch_size=32)
TEXT_SMALL = dict(
    val_fraction=0.1,
    block_size=16,
    ngram_order=4,
    val_batch_size=32,
    max_bytes=1 << 20,
    every_offset=False,
)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return GrammarCorpus(str(tmp_path_factory.mktemp("run") / "data"), seed=5, **SMALL)


def test_regeneration_is_byte_identical(tmp_path):
    a = GrammarCorpus(str(tmp_path / "a" / "data"), seed=5, **SMALL)
    b = GrammarCorpus(str(tmp_path / "b" / "data"), seed=5, **SMALL)
    assert a.directory.name == b.directory.name
    assert a.directory.parent == tmp_path / "a" / "data"
    assert _files(a.directory) == _files(b.directory)
    assert sorted(_files(a.directory)) == [
        "MANIFEST.json",
        "train.tokens",
        "val.tokens",
        "vocab.json",
    ]
    assert (
        a.manifest_hash
        == b.manifest_hash
        == hashlib.sha256(_files(a.directory)["MANIFEST.json"]).hexdigest()
    )


def test_another_seed_or_size_is_another_corpus(tmp_path, small):
    other = GrammarCorpus(str(tmp_path / "data"), seed=6, **SMALL)
    assert other.manifest_hash != small.manifest_hash
    assert other.directory.name != small.directory.name
    bigger = GrammarCorpus(str(tmp_path / "data"), seed=5, **{**SMALL, "n_sentences": 1600})
    assert bigger.manifest_hash != small.manifest_hash


def test_manifest_describes_every_file(small):
    m = json.loads((small.directory / "MANIFEST.json").read_bytes())
    assert (small.directory / "MANIFEST.json").read_bytes() == corpus.canonical_json(m)
    assert small.directory.name == f"grammar-{corpus.short_hash(m['params'])}"
    assert (
        m["generator"] == "grammar" and m["seed"] == 5 and m["vocab_size"] == small.spec.vocab_size
    )
    for name, entry in m["files"].items():
        data = (small.directory / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    train = np.frombuffer((small.directory / "train.tokens").read_bytes(), dtype="<u2")
    assert m["tokens"]["train"] == len(train) and train.max() < m["vocab_size"]
    assert small.vocab == json.loads((small.directory / "vocab.json").read_bytes())
    ppl = small.baseline_metrics()["val/ngram_baseline_ppl"]
    assert ppl == m["baseline"]["val_ppl"] and 1 < ppl < small.spec.vocab_size
    assert m["baseline"]["val_targets"] == small.n_val * small.spec.block_size


def test_train_windows_shift_by_one(small):
    T, toks = small.spec.block_size, small.tokens["train"]
    ids = np.array([0, 3, small.n_train - 1], dtype=np.int64)
    b = small.train_batch(ids, np.float32)
    assert b.x.shape == b.y.shape == (3, T) and b.x.dtype == b.y.dtype == np.int64
    np.testing.assert_array_equal(b.ids, ids)
    np.testing.assert_array_equal(b.x[:, 1:], b.y[:, :-1])
    for row, i in enumerate(ids):
        np.testing.assert_array_equal(b.x[row], toks[i * T : i * T + T])
        np.testing.assert_array_equal(b.y[row], toks[i * T + 1 : i * T + T + 1])
    assert small.n_train == (len(toks) - 1) // T
    assert small.augment(b, streams=None) is b
    with pytest.raises(
        IndexError, match=r"train window ids must be in \[0, \d+\), got \[\d+, \d+\]"
    ):
        small.train_batch(np.array([small.n_train]), np.float32)


def test_val_batches_cover_each_window_once_in_a_fixed_order(small):
    batches = list(small.val_batches(np.float32))
    ids = np.concatenate([b.ids for b in batches])
    np.testing.assert_array_equal(ids, np.arange(small.n_val))
    assert all(len(b.ids) == small.val_batch_size for b in batches[:-1])
    ys = np.concatenate([b.y.reshape(-1) for b in batches])
    T = small.spec.block_size
    np.testing.assert_array_equal(ys, small.tokens["val"][1 : small.n_val * T + 1])
    again = list(small.val_batches(np.float32))
    assert all(np.array_equal(a.x, b.x) for a, b in zip(batches, again))


def test_decode_reads_back_words(small):
    text = small.decode(small.tokens["val"][:40])
    assert "<eos>" in text and text.split(" ")[0] in small.vocab


def _copy_of(small, tmp_path) -> Path:
    target = tmp_path / "data" / small.directory.name
    target.mkdir(parents=True)
    for name, data in _files(small.directory).items():
        (target / name).write_bytes(data)
    return target


def test_corrupt_file_is_named_in_the_error(tmp_path, small):
    target = _copy_of(small, tmp_path)
    data = bytearray((target / "train.tokens").read_bytes())
    data[10] ^= 1
    (target / "train.tokens").write_bytes(bytes(data))
    mismatch = r"train\.tokens: sha256 mismatch with MANIFEST\.json; delete .* to regenerate"
    with pytest.raises(ValueError, match=mismatch):
        GrammarCorpus(str(tmp_path / "data"), seed=5, **SMALL)
    (target / "train.tokens").write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match=r"train\.tokens: \d+ bytes but MANIFEST\.json says"):
        GrammarCorpus(str(tmp_path / "data"), seed=5, **SMALL)
    (target / "train.tokens").write_bytes(_files(small.directory)["train.tokens"])
    (target / "val.tokens").unlink()
    with pytest.raises(ValueError, match=r"val\.tokens: missing"):
        corpus.verify_corpus(target)


def test_edited_manifest_is_refused(tmp_path, small):
    target = _copy_of(small, tmp_path)
    m = json.loads((target / "MANIFEST.json").read_bytes())
    m["baseline"]["val_ppl"] = 1.0
    (target / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"MANIFEST\.json: not in canonical form"):
        GrammarCorpus(str(tmp_path / "data"), seed=5, **SMALL)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda raw: raw.replace(b"{\n", b'{\n  "files": {},\n', 1), "duplicate key 'files'"),
        (
            lambda raw: raw.replace(b'"val_ppl": ', b'"val_ppl": 1e999, "x": ', 1),
            "number 1e999 is out of range",
        ),
    ],
    ids=["duplicate-files", "1e999"],
)
def test_a_manifest_that_readers_would_read_differently_is_refused(tmp_path, small, edit, words):
    target = _copy_of(small, tmp_path)
    raw = (target / "MANIFEST.json").read_bytes()
    (target / "MANIFEST.json").write_bytes(edit(raw))
    with pytest.raises(ValueError, match=rf"MANIFEST\.json: {words}.*; delete .* to regenerate"):
        corpus.verify_corpus(target)


@pytest.mark.parametrize("params", [None, {"seed": 5}], ids=["any-params", "these-params"])
def test_a_manifest_that_is_not_an_object_is_refused_in_one_line(tmp_path, small, params):
    target = _copy_of(small, tmp_path)
    (target / "MANIFEST.json").write_bytes(
        corpus.canonical_json([])
    )  # canonical JSON, but not a manifest
    with pytest.raises(ValueError, match=r"MANIFEST\.json: .*; delete .* to regenerate"):
        corpus.verify_corpus(target, params)


def test_leftover_temp_dirs_are_ignored(tmp_path, small):
    params = json.loads((small.directory / "MANIFEST.json").read_bytes())["params"]
    stale = tmp_path / "data" / f".tmp-{small.directory.name}-dead"
    stale.mkdir(parents=True)
    (stale / "train.tokens").write_bytes(b"partial")
    os.utime(stale, (0, 0))  # as old as a crashed writer's
    fresh = tmp_path / "data" / f".tmp-{small.directory.name}-busy"
    fresh.mkdir()
    d = GrammarCorpus(str(tmp_path / "data"), seed=5, **SMALL)
    assert d.manifest_hash == small.manifest_hash and d.manifest["params"] == params
    assert not stale.exists() and fresh.exists()  # a live writer's directory is left alone


def test_a_writer_that_loses_the_race_reuses_the_winner(tmp_path, small):
    params = json.loads((small.directory / "MANIFEST.json").read_bytes())["params"]
    build = lambda: build_grammar_corpus(5, SMALL["n_sentences"], 0.1)  # noqa: E731

    def slow_build():
        # Another writer publishes while this one is still building.
        corpus.ensure_corpus(tmp_path / "data", "grammar", params, build)
        return build()

    directory = corpus.ensure_corpus(tmp_path / "data", "grammar", params, slow_build)
    assert _files(directory) == _files(small.directory)
    assert [p.name for p in (tmp_path / "data").iterdir()] == [small.directory.name]  # no temp left


_CHILD = """
import sys
from pipeline.data.grammar import GrammarCorpus
d = GrammarCorpus(sys.argv[1], seed=21, n_sentences=4000, val_fraction=0.1, block_size=32, ngram_order=3,
                  val_batch_size=32)
print(d.manifest_hash)
"""


def test_two_processes_generating_at_once_both_succeed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path / "data")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    hashes = {out.strip() for out, _ in outs}
    assert len(hashes) == 1
    (directory,) = (tmp_path / "data").iterdir()
    assert hashlib.sha256((directory / "MANIFEST.json").read_bytes()).hexdigest() in hashes


TEXT = "It was the best of times, it was the worst of times; it was the age of wisdom.\n" * 30


def test_text_corpus_from_a_small_file(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text(TEXT + "café ☕\n", encoding="utf-8")
    d = TextCorpus(str(tmp_path / "run" / "data"), str(src), **TEXT_SMALL)
    assert d.directory.name.startswith("text-") and d.vocab == sorted(
        set(src.read_text(encoding="utf-8"))
    )
    assert d.decode(np.concatenate([d.tokens["train"], d.tokens["val"]])) == src.read_text(
        encoding="utf-8"
    )
    b = d.train_batch(np.arange(min(4, d.n_train)), np.float32)
    np.testing.assert_array_equal(b.x[:, 1:], b.y[:, :-1])
    assert 1 < d.baseline_metrics()["val/ngram_baseline_ppl"] < len(d.vocab)
    # The hash is over the content: a moved copy is the same corpus, an edited one is not.
    moved = tmp_path / "elsewhere.txt"
    moved.write_bytes(src.read_bytes())
    assert (
        TextCorpus(str(tmp_path / "run" / "data"), str(moved), **TEXT_SMALL).directory
        == d.directory
    )
    moved.write_text(TEXT + "café!\n", encoding="utf-8")
    assert (
        TextCorpus(str(tmp_path / "run" / "data"), str(moved), **TEXT_SMALL).directory
        != d.directory
    )


def test_text_corpus_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt: text file not found"):
        TextCorpus(str(tmp_path / "data"), str(missing), **TEXT_SMALL)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("naïve café ".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"latin1\.txt: not valid UTF-8"):
        TextCorpus(str(tmp_path / "data"), str(latin1), **TEXT_SMALL)
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(ValueError, match=r"short\.txt: too short"):
        TextCorpus(str(tmp_path / "data"), str(short), **TEXT_SMALL)
    wide = tmp_path / "wide.txt"
    wide.write_text("".join(chr(0x4E00 + i) for i in range(600)) * 2, encoding="utf-8")
    with pytest.raises(ValueError, match=r"wide\.txt: 600 distinct characters"):
        TextCorpus(str(tmp_path / "data"), str(wide), **TEXT_SMALL)


def test_a_linked_data_directory_never_receives_a_corpus(tmp_path):
    """<output_dir>/data linked elsewhere (a tool's cache as much as a run's): refused before anything is built."""
    from pipeline.files.atomic import UnsafePathError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "data")
    built = []
    with pytest.raises(UnsafePathError, match="data is a symlink"):
        corpus.ensure_corpus(tmp_path / "data", "grammar", {"seed": 0}, lambda: built.append(1))
    assert built == [] and os.listdir(elsewhere) == []


def test_a_corpus_is_found_by_its_manifests_hash_never_through_a_link_nor_in_a_temporary(
    small, tmp_path, monkeypatch
):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(small.directory, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", data / "a-linked")
    shutil.copytree(
        small.directory, data / f"{TMP_PREFIX}grammar-x"
    )  # a writer's, not yet published
    (data / "b-other").mkdir()
    (data / "b-other" / "MANIFEST.json").write_text("{}")
    assert corpus.find_corpus(data, small.manifest_hash) is None
    shutil.copytree(small.directory, data / "c-real")
    assert corpus.find_corpus(data, small.manifest_hash) == data / "c-real"
    os.symlink(data, tmp_path / "linked-data")
    assert corpus.find_corpus(tmp_path / "linked-data", small.manifest_hash) is None
    monkeypatch.setattr(corpus, "MAX_CORPORA", 3)  # c-real is the fourth entry: never looked at
    assert corpus.find_corpus(data, small.manifest_hash) is None


def test_a_text_corpus_is_memory_mapped_from_its_token_files(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text(TEXT, encoding="utf-8")
    d = TextCorpus(str(tmp_path / "data"), str(src), **TEXT_SMALL)
    for split in ("train", "val"):
        mapped = d.tokens[split]
        assert isinstance(mapped, np.memmap) and mapped.dtype == np.dtype("<u2")
        assert mapped.tobytes() == (d.directory / f"{split}.tokens").read_bytes()


def test_the_ngram_baseline_of_a_large_corpus_is_fitted_on_a_bounded_sample(
    tmp_path, monkeypatch, caplog
):
    import logging

    monkeypatch.setattr(corpus, "SAMPLE", 1000)
    monkeypatch.setattr(corpus, "SCORED", 100)
    src = tmp_path / "book.txt"
    src.write_text(TEXT, encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        d = TextCorpus(str(tmp_path / "data"), str(src), **TEXT_SMALL)
    baseline, T = d.manifest["baseline"], d.spec.block_size
    assert baseline["sample"] == {"train_tokens": 1000} and baseline["val_targets"] == 100 // T * T
    assert "a bounded sample" in caplog.text
    # the oracle: the n-gram fitted on the first 1000 train tokens, scored on the first val targets
    train, val = np.asarray(d.tokens["train"]), np.asarray(d.tokens["val"])
    lm = ngram_fit(train[:1000], TEXT_SMALL["ngram_order"], len(d.vocab))
    positions = corpus.val_target_positions(101, T)
    assert baseline["val_ppl"] == round(ngram_perplexity(lm, len(d.vocab), val, positions), 4)
    monkeypatch.undo()
    whole = TextCorpus(str(tmp_path / "whole"), str(src), **TEXT_SMALL)
    assert "sample" not in whole.manifest["baseline"]  # within the bounds: fitted and scored whole
