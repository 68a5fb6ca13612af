"""Every read is bounded in time and size (pipeline/files/reading.py): a FIFO, a device, a socket, a directory or a
link where the pipeline reads a file is refused by name before open(2) could block, whoever reads it
(inspect, evaluate, a run, a resume); data=text is read, hashed and tokenized in pieces, to the same bytes
the whole-file reading gave, and a file over data.max_bytes is refused unread."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import KERNODECK, env_for_subprocess, ngram_fit, ngram_perplexity, the_run, tree

from pipeline.config import identity
from pipeline.data import ngram
from pipeline.data import text as text_mod
from pipeline.data.text import TextCorpus, TextFile
from pipeline.files import reading
from pipeline.files.reading import UnreadableFile

# data=text's (a smaller bound)
TEXT = dict(
    val_fraction=0.1,
    block_size=64,
    ngram_order=5,
    val_batch_size=32,
    max_bytes=1 << 20,
    every_offset=False,
)

SAFETY_NET = (
    600  # seconds: only so a regression fails instead of hanging; a refusal takes a few seconds
)
KINDS = ("fifo", "device", "socket")
WHAT = {
    "fifo": "is a FIFO, not a regular file",
    "device": "is a character device, not a regular file",
    "socket": "is a socket, not a regular file",
}


def plant(path: Path, kind: str) -> Path:
    """Replace `path` (if any) by a FIFO, a character device like /dev/zero, or a bound UNIX socket."""
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("creating a device node needs root (CAP_MKNOD)")
    else:  # bound from inside its directory: a socket's path is at most 108 bytes
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import socket; socket.socket(socket.AF_UNIX).bind({path.name!r})",
            ],
            cwd=path.parent,
            check=True,
            timeout=SAFETY_NET,
        )
    return path


def command(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=SAFETY_NET,
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert proc.stdout == "" and len(lines) == 1, proc.stderr
    return lines[0]


# --- the one open -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_open_file_refuses_what_is_not_a_regular_file_without_blocking(kind, tmp_path):
    p = plant(tmp_path / "f", kind)
    for follow in (False, True):
        with pytest.raises(UnreadableFile, match=f"^{p}: {WHAT[kind]}$"):
            reading.open_file(p, follow=follow)
    link = tmp_path / "link"
    os.symlink(p, link)
    with pytest.raises(UnreadableFile, match="is a symlink, not a regular file") as e:
        reading.read_bytes(link, 1 << 20)
    assert (
        e.value.errno == 40
    )  # ELOOP, as O_NOFOLLOW says it: checkpoint readers name it "a symlink"
    with pytest.raises(
        UnreadableFile, match=WHAT[kind]
    ):  # followed on purpose: its target is refused
        reading.sha256(link, follow=True)
    with pytest.raises(UnreadableFile, match="is a directory, not a regular file"):
        reading.read_bytes(tmp_path, 1 << 20)
    with pytest.raises(UnreadableFile, match="is a character device"):
        reading.sha256("/dev/zero", follow=True)


def test_a_fifo_swapped_in_after_the_stat_is_refused_at_the_descriptor(tmp_path, monkeypatch):
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    fifo = plant(tmp_path / "fifo", "fifo")
    real_stat = os.stat
    monkeypatch.setattr(
        reading.os, "stat", lambda p, follow_symlinks=True: real_stat(regular)
    )  # the race lost
    with pytest.raises(
        UnreadableFile, match="is a FIFO, not a regular file"
    ):  # O_NONBLOCK: no writer needed
        reading.open_file(fifo)


def test_sizes_are_bounded_before_and_while_reading(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse
    with pytest.raises(
        UnreadableFile, match=r"1073741824 bytes, over the 1024-byte limit set by data.max_bytes"
    ):
        reading.sha256(big, 1024, bound="data.max_bytes")
    small = tmp_path / "small"
    small.write_bytes(b"abc")
    assert reading.read_bytes(small, 3) == b"abc"
    assert reading.sha256(small) == hashlib.sha256(b"abc").hexdigest()
    with reading.open_file(small) as f:  # a file that grows past the bound while read
        small.write_bytes(b"abcdef")
        with pytest.raises(UnreadableFile, match="grew past the 4-byte limit"):
            b"".join(reading.chunks(f, small, 4))
    target = tmp_path / "target.txt"
    target.write_bytes(b"data")
    os.symlink(
        target, tmp_path / "data-link.txt"
    )  # a user's data file may be a link: followed on purpose
    assert (
        reading.sha256(tmp_path / "data-link.txt", follow=True)
        == hashlib.sha256(b"data").hexdigest()
    )


def test_source_hashes_refuse_a_file_over_its_bound_unread(tmp_path):
    p = tmp_path / "t.txt"
    with open(p, "wb") as f:
        f.truncate(2000)
    config = {"data": {"path": str(p), "max_bytes": 1000}}
    with pytest.raises(
        UnreadableFile, match=r"2000 bytes, over the 1000-byte limit set by data.max_bytes"
    ):
        identity.source_hashes(config)
    config["data"]["max_bytes"] = 2000
    assert identity.source_hashes(config) == {"data.path": hashlib.sha256(bytes(2000)).hexdigest()}
    assert (
        "max_bytes" not in identity.semantic_config(config, {"data.path": "x"})["data"]
    )  # not the run's identity


# --- data=text in pieces: the bytes the whole-file reading gave ---------------------------------------------


def random_text(rng: np.random.Generator, n: int) -> str:
    alphabet = [*list("ab c\n,é—日本🙂\xa0ß"), "\ufeff"]
    return "".join(rng.choice(alphabet, n))


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 4096])
def test_text_in_pieces_equals_the_whole_file_decoded(piece, tmp_path, monkeypatch):
    monkeypatch.setattr(text_mod, "PIECE", piece)  # pieces cut characters at every possible byte
    rng = np.random.default_rng(piece)
    text = random_text(rng, 3000)
    p = tmp_path / "t.txt"
    p.write_bytes(text.encode())
    with TextFile(p, 1 << 20) as f:
        tokens = np.concatenate([toks for _, toks in f.pieces(f.n)])  # every character a token
        vocab = sorted(set(text))  # the oracle: what reading the whole file into a str gave
        assert f.vocab == vocab and f.sha256 == hashlib.sha256(text.encode()).hexdigest()
        index = {ch: i for i, ch in enumerate(vocab)}
        np.testing.assert_array_equal(tokens, [index[ch] for ch in text])
        assert tokens.dtype == np.uint16
    raw = text.encode()
    for cut in rng.integers(0, len(raw), 12):  # a bad byte anywhere, and a character cut at the end
        for bad in (raw[:cut] + b"\xff" + raw[cut:], raw[:cut] + "日".encode()[:2]):
            p.write_bytes(bad)
            try:
                bad.decode("utf-8")
            except UnicodeDecodeError as e:
                expected = e.start
            with pytest.raises(
                ValueError, match=rf"not valid UTF-8 \(bad byte at offset {expected}\)"
            ):
                TextFile(p, 1 << 20)


def test_a_text_file_changed_between_its_passes_is_refused(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("abc" * 100)
    with TextFile(p, 1 << 20) as f:
        p.write_text("abd" * 100)  # same size, other bytes
        with pytest.raises(ValueError, match="changed while it was read"):
            list(f.pieces(f.n))


def test_text_corpus_errors_name_data_path(tmp_path):
    with pytest.raises(
        ValueError, match=r"data\.path=/dev/zero: is a character device, not a regular file"
    ):
        TextCorpus(str(tmp_path / "data"), "/dev/zero", **TEXT)
    p = tmp_path / "t.txt"
    p.write_text("abc" * 100)
    with pytest.raises(
        ValueError,
        match=r"data\.path=.*t\.txt: 300 bytes, over the 299-byte limit set by data\.max",
    ):
        TextCorpus(str(tmp_path / "data"), str(p), **{**TEXT, "max_bytes": 299})


def test_fitted_perplexity_is_fit_then_perplexity_to_the_last_bit(monkeypatch):
    monkeypatch.setattr(ngram, "PIECE", 333)  # scored in pieces, one level at a time
    rng = np.random.default_rng(0)
    for V, order in ((5, 3), (40, 5)):
        tokens = rng.integers(0, V, 20000).astype(np.uint16)
        train, val = tokens[:18000], tokens[18000:]
        positions = np.arange(1, 1985, dtype=np.int64)
        whole = ngram_perplexity(
            ngram_fit(train.astype(np.int64), order, V), V, val.astype(np.int64), positions
        )
        assert ngram.fitted_perplexity(train, order, V, val, positions) == whole


# --- the commands: inspect, evaluate, a run, a resume ------------------------------------------------------


def a_copy(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    return out, the_run(out) / "checkpoints" / "step-00000010"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "name", ["manifest.json", "weights.safetensors", "extra.json", "data.json"]
)
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused_by_every_reader(
    name, kind, finished, tmp_path
):
    out, ckpt = a_copy(finished, tmp_path)
    plant(ckpt / name, kind)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = tree(tmp_path)
    said = f"{name}: {WHAT[kind]}"
    inspect = command("pipeline.show", str(ckpt), cwd=cwd)
    assert inspect.returncode == 1, inspect.stdout + inspect.stderr
    assert inspect.stdout.strip().splitlines()[-1] == f"INVALID: checkpoint {ckpt}: {said}"
    assert said in one_line(command("pipeline.evaluate", str(ckpt), cwd=cwd), 2)
    assert said in one_line(command("pipeline.sample", str(ckpt), cwd=cwd), 2)
    resume = command(
        "pipeline",
        *KERNODECK,
        f"paths.output_dir={out}",
        "hydra/job_logging=disabled",
        "trainer.max_steps=12",
        f"resume.source={ckpt}",
        "resume.allow_changes=[trainer.max_steps]",
        cwd=cwd,
    )
    assert said in one_line(resume, 2)
    assert tree(tmp_path) == before  # nothing on disk changed (cwd included: it is still empty)


@pytest.mark.slow
def test_a_run_falls_back_past_a_checkpoint_whose_manifest_is_a_fifo(finished, tmp_path):
    out, ckpt = a_copy(finished, tmp_path)
    plant(ckpt / "manifest.json", "fifo")
    proc = command(
        "pipeline", *KERNODECK, f"paths.output_dir={out}", cwd=tmp_path / "out"
    )  # the same run again
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert f"falling back: checkpoint {ckpt}: manifest.json: is a FIFO, not a regular file" in said
    assert "resuming from step 6" in said and "done at step 10" in said


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "socket", "directory"])
def test_a_data_path_that_is_not_a_regular_file_is_bad_input(kind, finished, tmp_path):
    out, ckpt = a_copy(finished, tmp_path)
    (tmp_path / "d").mkdir()
    path = {
        "fifo": lambda: plant(tmp_path / "d" / "t.txt", "fifo"),
        "dev-zero": lambda: Path("/dev/zero"),
        "socket": lambda: plant(tmp_path / "d" / "t.txt", "socket"),
        "directory": lambda: tmp_path / "d",
    }[kind]()
    what = {
        "fifo": WHAT["fifo"],
        "dev-zero": WHAT["device"],
        "socket": WHAT["socket"],
        "directory": "is a directory, not a regular file",
    }[kind]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = tree(tmp_path)
    run = command(
        "pipeline",
        "data=text",
        f"data.path={path}",
        "tracking=none",
        f"paths.output_dir={out}",
        cwd=cwd,
    )
    assert one_line(run, 2) == f"pipeline: data.path={path}: {what}"
    evaluate = command("pipeline.evaluate", str(ckpt), "data=text", f"data.path={path}", cwd=cwd)
    assert f"data.path={path}: {what}" in one_line(evaluate, 2)
    assert tree(tmp_path) == before


# --- memory: data=text bounded by data.max_bytes, and a file at the bound builds within its bound -------------

REFUSED_RSS_MB = (
    300  # a refusal reads nothing: the interpreter and its imports (measured ~50-200 MB)
)
BUILD_RSS_MB = (
    1200  # a corpus just under the 32 MiB bound, prose-like: measured ~430 MB (docs/configs.md)
)
MEASURE = """
import os, sys
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[2:]], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def measured(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The command run by a small process that reports its peak RSS in MB (a child forked from pytest
    would count pytest's own memory)."""
    rss = cwd.parent / "maxrss.txt"
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(rss), *args],
        cwd=cwd,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=SAFETY_NET * 2,
    )
    return proc, int(rss.read_text()) / 1024


def word_salad(path: Path, size: int) -> None:
    """`size` bytes of prose-like text: 2000 made-up words, Zipf-distributed, in lines."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    words = [bytes(letters[rng.integers(0, 26, rng.integers(2, 10))]) for _ in range(2000)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(words[i] for i in rng.zipf(1.3, 200000) % 2000) + b".\n"
    path.write_bytes(bytes(out[:size]))


@pytest.mark.slow
def test_a_text_file_over_the_bound_is_refused_unread(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(200 << 20)  # sparse: 200 MB of NULs, valid UTF-8
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc, mb = measured(
        [
            "-m",
            "pipeline",
            "data=text",
            f"data.path={big}",
            "tracking=none",
            f"paths.output_dir={tmp_path / 'out'}",
        ],
        cwd,
    )
    assert one_line(proc, 2) == (
        f"pipeline: data.path={big}: 209715200 bytes, over the 33554432-byte limit set by "
        "data.max_bytes (raise it to read a bigger file)"
    )
    assert mb < REFUSED_RSS_MB, f"peak RSS {mb:.0f} MB"
    assert not any((tmp_path / "out").rglob("*"))  # no corpus, no run directory


@pytest.mark.slow
def test_a_text_file_just_under_the_bound_builds_within_its_memory_bound(tmp_path):
    from pipeline.config.compose import CONFIG_DIR

    max_bytes = yaml.safe_load((CONFIG_DIR / "data" / "text.yaml").read_text(encoding="utf-8"))[
        "max_bytes"
    ]
    p = tmp_path / "t.txt"
    word_salad(p, max_bytes - 1)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    build = (
        "from pipeline.data.text import TextCorpus; import sys; "
        "d = TextCorpus(sys.argv[1], sys.argv[2], val_fraction=0.1, block_size=64, ngram_order=5, "
        f"val_batch_size=32, max_bytes={max_bytes}, every_offset=False); "
        "print(d.n_train, d.n_val, d.manifest['baseline']['val_ppl'])"
    )
    proc, mb = measured(["-c", build, str(tmp_path / "data"), str(p)], cwd)
    assert proc.returncode == 0, proc.stderr
    n_train, n_val, ppl = proc.stdout.split()
    assert int(n_train) + int(n_val) >= (max_bytes - 1) // 64 - 2 and float(ppl) > 1
    assert mb < BUILD_RSS_MB, f"peak RSS {mb:.0f} MB for a {max_bytes >> 20} MiB file"


@pytest.mark.slow
def test_reindex_names_a_checkpoint_it_cannot_read_never_skips_it_silently(finished, tmp_path):
    out, ckpt = a_copy(finished, tmp_path)
    plant(ckpt / "manifest.json", "fifo")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = command(
        "pipeline.reindex",
        str(out),
        "--tracking-uri",
        f"sqlite:///{tmp_path / 'index.db'}",
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"not indexed, damaged: checkpoint {ckpt}: manifest.json: {WHAT['fifo']}" in proc.stdout
    ), proc.stdout
