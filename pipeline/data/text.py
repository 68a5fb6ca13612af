"""A character-level corpus from the user's own UTF-8 text file, read in pieces (never whole, never a str)."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import itertools
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import numpy as np

from pipeline.data.corpus import MAX_VOCAB, TOKEN_DTYPE, CorpusContent, TokenDataset, n_windows
from pipeline.files import reading

TEXT_VERSION = 1
PIECE = 4 << 20  # bytes decoded at a time: at most ~9x in memory (its str, its UTF-32 copy)
N_CODE_POINTS = 0x110000


class TextError(ValueError):
    """data.path is not a text file the corpus can be built from (one line naming it)."""

    def __init__(self, path, why):
        super().__init__(f"data.path={path}: {why}")


def _code_points(pieces: Iterable[bytes], path: Path) -> Iterator[np.ndarray]:
    """The characters of a file's pieces as code points (uint8 for an ASCII piece, else uint32)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0  # offset: the piece's first byte's
    for raw in itertools.chain(pieces, [b""]):  # b"": the end, where a cut character is an error
        pending = len(decoder.getstate()[0])  # bytes of a character the previous piece cut
        try:
            if raw and not pending and raw.isascii():
                yield np.frombuffer(raw, dtype=np.uint8)  # its bytes are its code points
            else:
                yield np.frombuffer(decoder.decode(raw, final=not raw).encode("utf-32-le"), "<u4")
        except UnicodeDecodeError as e:
            at = offset - pending + e.start
            raise TextError(path, f"not valid UTF-8 (bad byte at offset {at})") from None
        offset += len(raw)


class TextFile(contextlib.AbstractContextManager):
    """data.path scanned once in pieces (memory: a few): its sha256, UTF-8, vocabulary (as sorted(set(text))); pieces()
    is a second pass. TextError or an OSError (a FIFO, a device, over `max_bytes`... refused unopened) names it."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = Path(path), int(max_bytes)
        self.f = reading.open_file(self.path, self.max_bytes, follow=True, bound="data.max_bytes")
        try:
            h, seen, self.n = hashlib.sha256(), np.zeros(N_CODE_POINTS, dtype=bool), 0
            for cps in _code_points(self._pieces(h), self.path):
                counts = np.bincount(cps)  # [max + 1]: ~2x faster than seen[cps] = True
                seen[: len(counts)] |= counts > 0
                self.n += len(cps)
            self.sha256 = h.hexdigest()
            self.code_points = np.flatnonzero(seen)  # the vocabulary, sorted
            self.vocab = [chr(c) for c in self.code_points]
            if (n := len(self.code_points)) > MAX_VOCAB:
                many = f"{n} distinct characters, more than the {MAX_VOCAB} allowed"
                raise TextError(self.path, many)
        except BaseException:
            self.f.close()
            raise

    def _pieces(self, h) -> Iterator[bytes]:
        """The file's bytes from its start, piece by piece, each added to the hash `h` as it is read."""
        self.f.seek(0)
        for raw in reading.chunks(self.f, self.path, self.max_bytes, "data.max_bytes", size=PIECE):
            h.update(raw)
            yield raw

    def pieces(self, n_train: int) -> Iterator[tuple[str, np.ndarray]]:
        """("train" | "val", [n] uint16 ids) in file order, n_train first: a second pass, refused if the file changed"""
        table = np.zeros(N_CODE_POINTS, dtype=TOKEN_DTYPE)  # code point -> token id
        table[self.code_points] = np.arange(len(self.code_points), dtype=TOKEN_DTYPE)
        at, h = 0, hashlib.sha256()
        for cps in _code_points(self._pieces(h), self.path):
            toks = np.take(table, cps[: max(0, self.n - at)])
            cut = min(max(0, n_train - at), len(toks))
            for split, part in (("train", toks[:cut]), ("val", toks[cut:])):
                if len(part):  # no empty piece: it would split its split's run of pieces
                    yield split, part
            at += len(cps)
        if at != self.n or h.hexdigest() != self.sha256:
            raise TextError(self.path, "changed while it was read; give it once it is complete")

    def content(self, val_fraction: float, block_size: int) -> CorpusContent:
        """The corpus, streamed: the last val_fraction of the text held out whole (no val window overlaps training)."""
        n_val = round(self.n * val_fraction)
        n_train = self.n - n_val
        if min(n_windows(n_train, block_size), n_windows(n_val, block_size)) < 1:
            short = f"too short: {self.n} characters leave {n_train} train and {n_val} val"
            raise TextError(self.path, f"{short}, each needing at least {block_size + 1}")
        stats = {"characters": {"train": n_train, "val": n_val}}
        return CorpusContent(vocab=self.vocab, join="", pieces=self.pieces(n_train), stats=stats)

    def __exit__(self, *exc) -> None:
        self.f.close()


class TextCorpus(TokenDataset):
    """`data=text data.path=FILE`: its characters in data/text-<hash>/, hashed by content (not path, not max_bytes)."""

    def __init__(
        self,
        cache_dir: str,
        path: str,
        val_fraction: float,
        block_size: int,
        ngram_order: int,
        val_batch_size: int,
        max_bytes: int,
        every_offset: bool,
    ):
        try:
            text = TextFile(Path(path), max_bytes)
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path={path}: text file not found") from None
        except OSError as e:
            raise TextError(path, e.strerror or e) from None
        with text:
            params = {"generator": "text", "version": TEXT_VERSION, "source_sha256": text.sha256}
            params.update(val_fraction=float(val_fraction), block_size=int(block_size))
            params["ngram_order"] = int(ngram_order)
            build = partial(text.content, float(val_fraction), int(block_size))
            super().__init__(cache_dir, params, val_batch_size, build, bool(every_offset))
