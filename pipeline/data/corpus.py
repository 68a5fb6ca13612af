"""Token corpora on disk (written once, atomically, with a hashed MANIFEST.json) and the dataset over them."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from pipeline.data import ngram
from pipeline.data.base import Batch, DataSpec
from pipeline.files import atomic, jsonio, listing, reading
from pipeline.files.limits import MAX_CORPORA, MAX_CORPUS_JSON, MAX_TOKEN_FILE

FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")  # raw little-endian uint16: vocabularies stay <= 512
MAX_VOCAB = 512
SPLITS = ("train", "val")
MANIFEST = "MANIFEST.json"
SAMPLE, SCORED = 1 << 22, 1 << 20  # n-gram baseline: train tokens fitted, val targets scored (~3 s)
log = logging.getLogger("pipeline")


@dataclass
class CorpusContent:
    """What a generator hands over: the vocabulary, both splits' (split, [n] tokens) `pieces`, train's first; stats."""

    vocab: list[str]
    join: str  # decode() puts this between tokens: " " for words, "" for characters
    pieces: Iterable[tuple[str, np.ndarray]]
    stats: dict = field(default_factory=dict)


Build = Callable[[], CorpusContent]  # a corpus's generator, called only if its directory is absent


def canonical_json(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode("ascii")


def short_hash(params: dict) -> str:
    return hashlib.sha256(canonical_json(params)).hexdigest()[:12]


def n_windows(n_tokens: int, block_size: int) -> int:
    # Window i is tokens[i*T : i*T+T+1]: x is its first T tokens, y its last T.
    return max(0, (n_tokens - 1) // block_size)


def val_target_positions(n_tokens: int, block_size: int) -> np.ndarray:
    """Stream positions of every y token of the val windows, i.e. exactly what val loss scores."""
    return np.arange(1, n_windows(n_tokens, block_size) * block_size + 1, dtype=np.int64)


def write_corpus(directory: Path, content: CorpusContent, name: str, params: dict) -> bytes:
    """The corpus's files into `directory`, tokens streamed, MANIFEST.json last: its bytes, a function of the input."""
    V, T, order = len(content.vocab), int(params["block_size"]), int(params["ngram_order"])
    if V > MAX_VOCAB:
        many = f"{name} corpus has {V} distinct tokens, more than the {MAX_VOCAB} allowed"
        raise ValueError(many)
    vocab = canonical_json(list(content.vocab))
    files = {"vocab.json": atomic.write_new(directory / "vocab.json", vocab)}
    for split, group in itertools.groupby(content.pieces, key=lambda piece: piece[0]):
        pieces = (np.ascontiguousarray(toks, dtype=TOKEN_DTYPE) for _, toks in group)  # [n] each
        files[f"{split}.tokens"] = atomic.write_new(directory / f"{split}.tokens", pieces)
    n = {s: files.get(f"{s}.tokens", {"size": 0})["size"] // TOKEN_DTYPE.itemsize for s in SPLITS}
    for split in (s for s in SPLITS if n_windows(n[s], T) < 1):  # the first too short is refused
        few = f"{name} corpus {split} split has {n[split]} tokens, too few for one block of {T}+1"
        raise ValueError(few)
    listed = {f: {"sha256": e["sha256"], "bytes": e["size"]} for f, e in sorted(files.items())}
    tokens = {s: _mapped(directory, s, listed) for s in SPLITS}
    # The n-gram's memory is bounded whatever the text's size (a corpus within SAMPLE and SCORED: as a whole).
    positions, train = val_target_positions(min(n["val"], SCORED + 1), T), tokens["train"][:SAMPLE]
    baseline = {"model": "interpolated modified Kneser-Ney", "ngram_order": order}
    if len(train) < n["train"] or len(positions) < n_windows(n["val"], T) * T:
        baseline["sample"] = {"train_tokens": len(train)}
        _notice(
            f"the {name} corpus's n-gram baseline is fitted on its first {len(train)} train tokens and "
            f"scores its first {len(positions)} val targets (a bounded sample)"
        )
    ppl = ngram.fitted_perplexity(train, order, V, tokens["val"], positions)
    # Rounded so that last-ulp differences in log() between machines do not change the manifest bytes.
    baseline.update(val_targets=len(positions), val_ppl=round(ppl, 4))
    manifest = dict(format=FORMAT_VERSION, generator=name, params=params, seed=params.get("seed"))
    manifest.update(params_hash=short_hash(params), vocab_size=V, token_dtype=TOKEN_DTYPE.str)
    manifest.update(decode_join=content.join, tokens=n, stats=content.stats, files=listed)
    manifest.update(baseline=baseline, windows={s: n_windows(n[s], T) for s in SPLITS})
    raw = canonical_json(manifest)
    atomic.write_new(directory / MANIFEST, raw)
    return raw


def _mapped(directory: Path, split: str, listed: dict) -> np.ndarray:
    """A split's raw token file, of the size `listed` (MANIFEST.json's files) says, mapped read-only (no link)."""
    path = directory / f"{split}.tokens"
    n = listed[path.name]["bytes"] // TOKEN_DTYPE.itemsize
    with reading.open_file(path, MAX_TOKEN_FILE) as f:
        if os.fstat(f.fileno()).st_size != n * TOKEN_DTYPE.itemsize:
            raise ValueError(f"{path}: not {n} tokens of {TOKEN_DTYPE.itemsize} bytes")
        return np.memmap(f, dtype=TOKEN_DTYPE, mode="r", shape=(n,))


def verify_corpus(directory: Path, params: dict | None = None, keep=()) -> tuple[dict, dict]:
    """(the parsed manifest, {name: bytes} of MANIFEST.json and the files named in `keep`), after checking every
    file's size and sha256 (each read once, bounded, never through a link); a ValueError names what is wrong."""
    directory = Path(directory)
    try:  # an OSError names the file being read, MANIFEST.json
        raw = reading.read_bytes(directory / MANIFEST, MAX_CORPUS_JSON)
        manifest = jsonio.loads(raw)  # strict: a duplicate key or 1e999 is refused
        if canonical_json(manifest) != raw:
            raise _unusable(directory, "not in canonical form (edited by hand?)")
        said = manifest if isinstance(manifest, dict) else {}
        if params is not None and said.get("params") != params:
            raise _unusable(directory, f"params differ from the requested {params}")
        if not isinstance(files := said.get("files"), dict):
            raise _unusable(directory, "'files' must map file names to their bytes and sha256")
        kept = {fn: bytearray() for fn in keep if fn in files}
        found = listing.problems(
            directory, files, MANIFEST, kept=kept, words=WORDS, size_keys=("size", "bytes")
        )
        if problem := next(found, None):
            raise _unusable(directory, problem[1], problem[0])
    except (jsonio.JSONError, OSError) as e:
        why = "missing" if isinstance(e, FileNotFoundError) else getattr(e, "strerror", None) or e
        raise _unusable(directory, why) from None
    return manifest, {**{fn: bytes(b) for fn, b in kept.items()}, MANIFEST: raw}


def _unusable(directory: Path, why, name: str = MANIFEST) -> ValueError:
    """A corpus's refusal: what is wrong with which of its files, and the fix."""
    return ValueError(f"{directory / name}: {why}; delete {directory} to regenerate")


# a corpus's words for a file unlike its MANIFEST.json, since format 1
WORDS = {"missing": "missing", "sha256": "sha256 mismatch with {manifest}"}
WORDS["size"] = "{found} bytes but {manifest} says {size}"


def _notice(message: str) -> None:
    """`message` as INFO where the log has a handler, else on stderr if a terminal (a pipe's is for refusals)."""
    if log.hasHandlers():
        log.info(message)
    elif sys.stderr is not None and sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def ensure_corpus(data_dir: Path, name: str, params: dict, build: Build) -> Path:
    """<data_dir>/<name>-<hash>/, built by `build` only if absent, safe beside other writers; its reader verifies it."""
    parent = Path(data_dir)
    atomic.refuse_link(parent, "directory")  # <output_dir>/data linked elsewhere would receive it
    final = parent / f"{name}-{short_hash(params)}"
    if final.exists():
        return final
    atomic.ensure_dirs(parent)
    # Other writers may be generating it now: their temporaries are young; an hour-old one is a crashed writer's.
    atomic.remove_temporaries(parent, older_than=3600.0)
    hidden = ("generator", "version", "source_sha256")
    shown = ", ".join(f"{k}={v}" for k, v in params.items() if k not in hidden)
    _notice(
        f"generating the {name} corpus ({shown}) into {final}; this takes a while once, then it is cached"
    )
    tmp = atomic.new_temp_dir(parent, final.name)
    try:
        raw = write_corpus(tmp, build(), name, params)
        try:
            atomic.publish_dir(tmp, final)
            return final
        except OSError:
            if not final.exists():
                raise
            # Another writer published first; its bytes must equal ours, which verify checks.
    finally:
        atomic.remove_tree(tmp)
    if verify_corpus(final, params)[1][MANIFEST] != raw:
        # Same params, other bytes: the existing corpus came from another version of the generator.
        raise _unusable(final, "differs from the one these params generate")
    return final


def find_corpus(data_dir: Path, manifest_hash: str) -> Path | None:
    """The corpus in `data_dir` whose MANIFEST.json hashes to `manifest_hash`, if any (no link, no temporary)."""
    if not data_dir.is_dir() or data_dir.is_symlink():
        return None
    for e in sorted(os.scandir(data_dir), key=lambda e: e.name)[:MAX_CORPORA]:
        if not e.name.startswith(atomic.TMP_PREFIX) and e.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                if reading.sha256(Path(e.path) / MANIFEST, MAX_CORPUS_JSON) == manifest_hash:
                    return Path(e.path)
    return None


class TokenDataset:
    """Non-overlapping windows of T+1 tokens over a verified corpus directory (the Dataset protocol)."""

    kind = "tokens"
    keeps_corpus = True  # on disk, in the output's corpus cache (what `archive --with-data` copies)
    baselines = ("val/ngram_baseline_ppl",)  # what baseline_metrics gives
    specials: ClassVar[dict[str, str]] = {}  # role -> token ({"eos": "<eos>"}): tools start there

    def __init__(
        self, cache_dir: str, params: dict, val_batch_size: int, build: Build, every_offset=False
    ):
        self.directory = ensure_corpus(Path(cache_dir), params["generator"], params, build)
        self.manifest, files = verify_corpus(self.directory, params, keep=("vocab.json",))
        self.manifest_hash = hashlib.sha256(files[MANIFEST]).hexdigest()
        try:
            vocab = jsonio.loads(files["vocab.json"])
            if not (isinstance(vocab, list) and all(isinstance(t, str) for t in vocab)):
                raise ValueError("not a list of tokens")
        except ValueError as e:
            raise ValueError(f"{self.directory / 'vocab.json'}: {e}") from None
        self.vocab: list[str] = vocab
        # split -> [N] tokens memory-mapped from the verified files (uint16); batches are int64
        self.tokens = {s: _mapped(self.directory, s, self.manifest["files"]) for s in SPLITS}
        T = int(self.manifest["params"]["block_size"])
        self.spec = DataSpec(vocab_size=len(self.vocab), block_size=T)
        self.n_train, self.n_val = (n_windows(len(self.tokens[s]), T) for s in SPLITS)
        # every_offset: a sample is the window at any offset of the train stream (nanoGPT's); else the n_train windows
        self.n_offsets = len(self.tokens["train"]) - T if every_offset else 0
        self.val_batch_size, self._join = int(val_batch_size), self.manifest["decode_join"]

    def _batch(self, split: str, ids: np.ndarray, at_offsets: bool = False) -> Batch:
        """Samples `ids` [B] (window ids, or stream offsets): x the first T of their T+1 tokens, y the last T."""
        T = self.spec.block_size
        idx = (ids if at_offsets else ids * T)[:, None] + np.arange(T + 1)[None, :]  # [B, T+1]
        w = self.tokens[split][idx].astype(np.int64)
        return Batch(ids=ids, x=w[:, :-1], y=w[:, 1:])

    def train_batch(self, ids: np.ndarray, dtype: np.dtype | None = None) -> Batch:
        ids = np.asarray(ids, dtype=np.int64)  # [B] offsets (every_offset) or window ids
        lo, hi = (ids.min(), ids.max()) if ids.size else (0, 0)
        n = self.n_offsets or self.n_train
        if lo < 0 or hi >= n:
            raise IndexError(f"train window ids must be in [0, {n}), got [{lo}, {hi}]")
        return self._batch("train", ids.copy(), at_offsets=bool(self.n_offsets))

    def augment(self, batch: Batch, streams) -> Batch:
        return batch  # token data has no training-time randomness

    def val_batches(self, dtype: np.dtype | None = None) -> Iterator[Batch]:
        for start in range(0, self.n_val, self.val_batch_size):
            ids = np.arange(start, min(start + self.val_batch_size, self.n_val), dtype=np.int64)
            yield self._batch("val", ids)

    def baseline_metrics(self) -> dict[str, float]:
        return {self.baselines[0]: float(self.manifest["baseline"]["val_ppl"])}

    def decode(self, ids) -> str:
        return self._join.join(self.vocab[int(i)] for i in np.asarray(ids).reshape(-1))

    def inference_facts(self) -> dict:
        """What reading and writing the model's tokens needs of this data (a checkpoint's data.json)."""
        return dict(vocab=list(self.vocab), decode_join=self._join, specials=dict(self.specials))
