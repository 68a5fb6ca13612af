"""A character-level corpus from the user's own UTF-8 text file."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from pipeline.data.corpus import MAX_VOCAB, CorpusContent, TokenDataset, ensure_corpus, n_windows

TEXT_VERSION = 1


def read_text(path: Path) -> tuple[str, str]:
    """(text, sha256 of its bytes); a one-sentence error naming the path if it is missing or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: text file not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (bad byte at offset {e.start})") from None
    return text, hashlib.sha256(raw).hexdigest()


def build_text_corpus(path: Path, text: str, val_fraction: float, block_size: int) -> CorpusContent:
    vocab = sorted(set(text))
    if len(vocab) > MAX_VOCAB:
        raise ValueError(f"{path}: {len(vocab)} distinct characters, more than the {MAX_VOCAB} allowed")
    index = {ch: i for i, ch in enumerate(vocab)}
    tokens = np.fromiter((index[ch] for ch in text), dtype=np.int64, count=len(text))  # [N]
    # The last val_fraction of the text is held out, in one piece, so no val window overlaps training.
    n_val = int(round(len(tokens) * val_fraction))
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    if min(n_windows(len(train), block_size), n_windows(len(val), block_size)) < 1:
        raise ValueError(
            f"{path}: too short: {len(tokens)} characters leave {len(train)} train and {len(val)} val, "
            f"each needing at least {block_size + 1}"
        )
    stats = {"characters": {"train": int(len(train)), "val": int(len(val))}}
    return CorpusContent(train=train, val=val, vocab=vocab, join="", stats=stats)


class TextCorpus(TokenDataset):
    """`data=text data.path=FILE`: the file's characters under <output_dir>/data/text-<hash>/.

    The hash covers the file's content (its sha256), not its path: moving the file reuses the corpus.
    """

    def __init__(
        self,
        cache_dir: str,
        path: str,
        val_fraction: float = 0.1,
        block_size: int = 64,
        ngram_order: int = 5,
        val_batch_size: int = 32,
    ):
        text, sha = read_text(Path(path))
        params = {
            "generator": "text",
            "version": TEXT_VERSION,
            "source_sha256": sha,
            "val_fraction": float(val_fraction),
            "block_size": int(block_size),
            "ngram_order": int(ngram_order),
        }
        directory = ensure_corpus(
            Path(cache_dir), "text", params,
            lambda: build_text_corpus(Path(path), text, params["val_fraction"], params["block_size"]),
        )
        super().__init__(directory, val_batch_size=val_batch_size)
