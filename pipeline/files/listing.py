"""A directory against the manifest listing its files (size and sha256 each): the one check of a checkpoint, a
corpus and an archive (every listed file a regular file of its size and hash, nothing unlisted)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from pipeline.files import reading

SHA256 = re.compile(r"^[0-9a-f]{64}$")
# How each difference is said ({manifest}: the listing's name); a caller may say some its own way.
WORDS = {
    "unlisted": "present but not listed in {manifest}",
    "missing": "listed in {manifest} but missing",
    "size": "size {found} bytes, manifest says {size}",
    "sha256": "sha256 differs from {manifest} (corrupted)",
    "link": "link differs from {manifest}",
}


def size_of(entry, keys: tuple[str, ...] = ("size",)) -> int | None:
    """A listed file's size, under the first of `keys` it has; None if that is no count of bytes."""
    key = next((k for k in keys if k in entry), None) if isinstance(entry, dict) else None
    size = entry[key] if key is not None else None
    return size if type(size) is int and size >= 0 else None


def _tree(root: Path) -> tuple[dict[str, os.stat_result], set[str], dict[str, str]]:
    """(files, directories, links) under root, by path relative to it; no link followed."""
    files, dirs, links = {}, set(), {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in dirnames + filenames:
            full = Path(dirpath) / n
            rel, st = full.relative_to(root).as_posix(), os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                links[rel] = os.readlink(full)
            elif stat.S_ISDIR(st.st_mode):
                dirs.add(rel)
            else:
                files[rel] = st
    return files, dirs, links


def problems(
    root: Path,
    files: Mapping[str, dict],
    manifest: str,
    *,
    links: Mapping[str, str] | None = None,
    ignore: tuple[str, ...] = (),
    hashed: bool = True,
    kept: dict[str, bytearray] | None = None,
    words: Mapping[str, str] = WORDS,
    size_keys: tuple[str, ...] = ("size",),
) -> Iterator[tuple[str, str]]:
    """(path, reason) for each way `root` differs from `files` (listed by `manifest`, which it holds beside them,
    with `ignore`d names), lazily (a caller stops at the first: a million planted files cost nothing). `links`
    given: the listing is nested and lists those links too. `hashed`: read each file and compare its sha256;
    the files named in `kept` (its keys) are kept there whole, as read."""
    words = {**WORDS, **words}

    def say(kind: str, **values) -> str:
        return words[kind].format(manifest=manifest, **values)

    for rel, entry in files.items():  # the listing first: no name out of `root`, each entry whole
        parts = rel.split("/") if links is not None else [rel]
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        bad = any(p in ("", ".", "..") or set(p) & {"/", "\\", "\0"} for p in parts)
        if rel == manifest or bad:
            yield manifest, f"lists an invalid file name {rel!r:.80}"
            return
        if size_of(entry, size_keys) is None or not (isinstance(sha, str) and SHA256.match(sha)):
            yield manifest, f"entry for {rel:.80} needs an integer size and a sha256 hex digest"
            return
    skip = {manifest, *ignore}
    found: dict[str, os.stat_result] = {}
    if links is not None:
        found, dirs, linked = _tree(root)
        listed = (*files, *links)
        parents = {"/".join(r.split("/")[:i]) for r in listed for i in range(1, r.count("/") + 1)}
        for rel in sorted((set(found) - set(files) - skip) | (dirs - parents)):
            yield rel, say("unlisted")
    else:
        with os.scandir(root) as it:
            for e in it:
                if e.name in files:
                    found[e.name] = e.stat(follow_symlinks=False)
                elif e.name not in skip:
                    yield e.name, say("unlisted")
    for rel, entry in sorted(files.items()):
        size, st = size_of(entry, size_keys), found.get(rel)
        if st is None:
            yield rel, say("missing")
        elif not stat.S_ISREG(st.st_mode):
            yield rel, f"is {reading.kind_of(st)}, not a regular file"
        elif st.st_size != size:
            yield rel, say("size", found=st.st_size, size=size)
        elif hashed:
            into = bytearray(st.st_size) if kept is not None and rel in kept else None
            try:
                if reading.sha256(root / rel, st.st_size, into=into) != entry["sha256"]:
                    yield rel, say("sha256")
                elif into is not None:
                    kept[rel] = into  # type: ignore[index]  # kept is not None where into is
            except OSError as e:  # swapped or changed since the scan
                yield rel, e.strerror or str(e)
    if links is not None and linked != links:
        yield sorted(set(linked.items()) ^ set(links.items()))[0][0], say("link")
