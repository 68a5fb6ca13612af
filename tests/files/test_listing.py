"""The one check of a directory against the manifest listing it (pipeline/files/listing.py), as checkpoints,
corpora and archives use it: every listed file a regular file of its size and sha256, nothing unlisted."""

from __future__ import annotations

import hashlib
import os

import pytest

from pipeline.files import listing


def entry(data: bytes, key: str = "size") -> dict:
    return {key: len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture
def flat(tmp_path):
    files = {"a.bin": b"alpha", "b.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "M.json").write_text("the manifest itself")
    return tmp_path, {n: entry(d) for n, d in files.items()}


def said(root, files, **kw) -> list[tuple[str, str]]:
    return list(listing.problems(root, files, "M.json", **kw))


def test_a_directory_as_listed_has_no_problem_and_keeps_what_it_is_asked(flat):
    root, files = flat
    kept = {"a.bin": bytearray()}
    assert said(root, files, kept=kept) == [] and kept == {"a.bin": bytearray(b"alpha")}


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda r: (r / "stray").write_text("x"), ("stray", "present but not listed in M.json")),
        (lambda r: (r / "a.bin").unlink(), ("a.bin", "listed in M.json but missing")),
        (
            lambda r: (r / "a.bin").write_bytes(b"alphas"),
            ("a.bin", "size 6 bytes, manifest says 5"),
        ),
        (
            lambda r: (r / "a.bin").write_bytes(b"alphA"),
            ("a.bin", "sha256 differs from M.json (corrupted)"),
        ),
        (
            lambda r: ((r / "a.bin").unlink(), os.mkfifo(r / "a.bin")),
            ("a.bin", "is a FIFO, not a regular file"),
        ),
        (
            lambda r: ((r / "a.bin").rename(r / "x"), os.symlink("x", r / "a.bin")),
            ("x", "present but not listed in M.json"),
        ),
    ],
    ids=["unlisted", "missing", "size", "sha256", "fifo", "link"],
)
def test_each_difference_is_named(flat, damage, expected):
    root, files = flat
    damage(root)
    assert said(root, files)[0] == expected


def test_a_link_in_place_of_a_listed_file_is_refused(flat):
    root, files = flat
    (root / "a.bin").unlink()
    os.symlink("b.json", root / "a.bin")
    assert said(root, files, hashed=False) == [("a.bin", "is a symlink, not a regular file")]


@pytest.mark.parametrize("name", ["../x", "", ".", "M.json", "a/b"])
def test_a_listing_naming_a_path_out_of_its_directory_is_refused_first(flat, name):
    root, files = flat
    assert said(root, {**files, name: entry(b"")}) == [
        ("M.json", f"lists an invalid file name {name!r}")
    ]


def test_an_entry_without_size_and_hash_is_refused_and_an_older_key_read_where_asked(flat):
    root, files = flat
    old = {n: entry((root / n).read_bytes(), key="bytes") for n in files}
    assert said(root, old)[0] == (
        "M.json",
        "entry for a.bin needs an integer size and a sha256 hex digest",
    )
    assert said(root, old, size_keys=("size", "bytes")) == []


def test_a_nested_listing_lists_its_links_and_no_directory_holds_nothing_listed(tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "f").write_bytes(b"f")
    os.symlink("f", tmp_path / "runs" / "r" / "best")
    files, links = {"runs/r/f": entry(b"f")}, {"runs/r/best": "f"}
    assert said(tmp_path, files, links=links) == []
    (tmp_path / "runs" / "empty").mkdir()
    os.symlink("g", tmp_path / "runs" / "r" / "new")
    assert said(tmp_path, files, links=links) == [
        ("runs/empty", "present but not listed in M.json"),
        ("runs/r/new", "link differs from M.json"),
    ]


def test_a_corpus_with_a_file_its_manifest_does_not_list_is_refused(tmp_path):
    """Corpora are checked like checkpoints now: a planted file is named (it was ignored)."""
    from pipeline.data import corpus

    files = {"train.tokens": b"\x00\x01", "val.tokens": b"\x01\x00"}
    manifest = {"files": {n: entry(d, key="bytes") for n, d in files.items()}}
    for name, data in {**files, "MANIFEST.json": corpus.canonical_json(manifest)}.items():
        (tmp_path / name).write_bytes(data)
    assert corpus.verify_corpus(tmp_path)[0] == manifest  # keyed on `bytes`, as corpora always were
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match=r"notes\.txt: present but not listed in MANIFEST\.json; delete"
    ):
        corpus.verify_corpus(tmp_path)
