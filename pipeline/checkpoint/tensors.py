"""Named arrays to and from safetensors files, hashed in the pass that writes or reads them (BENCHMARKS.md)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pipeline.files import jsonio, reading
from pipeline.files.atomic import write_new
from pipeline.files.limits import MAX_HEADER

ALIAS = re.compile(r"^ALIAS\((.+)\)$")
CHUNK = 8 << 20  # bytes per write/read/hash step

# safetensors' dtype codes, in the library's own order (its writer puts wider codes first); BF16: no numpy type.
CODES = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
NUMPY = ("?", "u1", "i1", "i2", "u2", "f2", None, "i4", "u4", "f4", "f8", "i8", "u8")
TO_NUMPY = {code: np.dtype(t).newbyteorder("<") for code, t in zip(CODES, NUMPY) if t}
FROM_NUMPY = {dt: code for code, dt in TO_NUMPY.items()}
RANK = {code: i for i, code in enumerate(CODES)}


class DigestMismatch(ValueError):
    """The file's bytes do not hash to the sha256 the caller expected."""


class _Hasher(ThreadPoolExecutor):
    """sha256 on a helper thread, fed views of arrays that exist anyway (unbounded: the writer's fsync overlaps)."""

    def __init__(self):
        super().__init__(1, thread_name_prefix="sha256")
        self._h, self._pending = hashlib.sha256(), deque[Future]()

    def update(self, buf) -> None:
        # hashlib releases the GIL on big buffers
        self._pending.append(self.submit(self._h.update, buf))
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # surfaces errors early, keeps the queue short

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return self._h.hexdigest()

    def __exit__(self, *exc) -> None:
        self.shutdown(wait=True, cancel_futures=True)


def _code(a: np.ndarray) -> str:
    return FROM_NUMPY[a.dtype.newbyteorder("<")]


def _bytes_of(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data  # a is C-contiguous: both are views, no copy


def split_aliases(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Unique arrays by first name (C-contiguous), and alias -> canonical name for later names of one object."""
    by_id: dict[int, str] = {}
    unique, aliases = {}, {}
    for name, a in arrays.items():
        if (first := by_id.setdefault(id(a), name)) != name:
            aliases[name] = first
            continue
        a = np.asarray(a)
        if (little := a.dtype.newbyteorder("<")) not in FROM_NUMPY:
            raise ValueError(f"{name}: dtype {a.dtype} cannot be stored in safetensors")
        # C-contiguous little-endian, copied only if not already (np.ascontiguousarray would make 0-d [1])
        unique[name] = np.asarray(a, dtype=little, order="C")
    return unique, aliases


def write_tensors(path: Path, arrays: dict, metadata: dict | None = None, fsync=True) -> dict:
    """A new safetensors file at `path`, in the library's own layout, fsynced; returns its {"size", "sha256"}."""
    unique, aliases = split_aliases(arrays)
    meta = {"format": "np", **(metadata or {}), **{k: f"ALIAS({v})" for k, v in aliases.items()}}
    if bad := [k for k, v in meta.items() if not (isinstance(k, str) and isinstance(v, str))]:
        raise ValueError(f"safetensors metadata is str -> str only; not so for {bad}")
    if "__metadata__" in unique:
        raise ValueError("'__metadata__' cannot name a tensor")
    order = sorted(unique, key=lambda n: (-RANK[_code(unique[n])], n))
    # Metadata sorted: the library serialises it from a hash map whose order changes from process to
    # process, and equal states must give equal bytes (a resumed process re-saves the same step).
    header: dict = {"__metadata__": dict(sorted(meta.items()))}
    for name, end in zip(order, itertools.accumulate(unique[n].nbytes for n in order)):
        a = unique[name]
        header[name] = dict(dtype=_code(a), shape=list(a.shape), data_offsets=[end - a.nbytes, end])
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    views = [_bytes_of(unique[name]) for name in order]
    chunks = (v[i : i + CHUNK] for v in views for i in range(0, len(v), CHUNK))
    with _Hasher() as h:  # each piece hashed on the helper thread while this one writes it
        return write_new(path, itertools.chain([head], chunks), h, fsync)


class _Malformed(ValueError):
    """Not a safetensors file (the reason)."""


class LayoutMisfit(_Malformed):
    """A file that verifies but holds other names, dtypes or shapes than the live state expects."""


def _read_exact(f, buf: memoryview, h: _Hasher) -> memoryview:
    """`buf` filled from `f`, then hashed (on the helper thread while this one reads on)."""
    got = 0
    while got < len(buf) and (n := f.readinto(buf[got:])):
        got += n
    if got < len(buf):
        raise _Malformed("truncated: the file ends inside the data the header describes")
    h.update(buf)
    return buf


def _check_header(header, data_len: int) -> tuple[dict[str, str], list[tuple]]:
    """(metadata, [(name, dtype, shape, nbytes)] in data order) or _Malformed, as the library validates."""
    if not isinstance(header, dict):
        raise _Malformed("header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _Malformed("__metadata__ is not a str -> str object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            why = "needs dtype, shape and data_offsets [begin, end]"
            raise _Malformed(f"tensor {name!r}: {why}") from None
        if not isinstance(code, str) or code not in TO_NUMPY:
            raise _Malformed(f"tensor {name!r}: dtype {code!r} has no numpy equivalent here")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _Malformed(f"tensor {name!r}: bad shape {shape!r}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
            raise _Malformed(f"tensor {name!r}: bad data_offsets {[begin, end]!r}")
        dtype = TO_NUMPY[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            why = f"data_offsets span {end - begin} bytes, shape needs {nbytes}"
            raise _Malformed(f"tensor {name!r}: {why}")
        entries.append((begin, name, dtype, tuple(shape), nbytes))
    entries.sort(key=lambda e: (e[0], e[0] + e[4]))
    position = 0
    for begin, name, _, _, nbytes in entries:
        if begin != position:
            why = f"data_offsets overlap or leave a gap (starts at {begin}, expected {position})"
            raise _Malformed(f"tensor {name!r}: {why}")
        position += nbytes
    if position != data_len:
        raise _Malformed(f"the tensors cover {position} data bytes, the file holds {data_len}")
    return metadata, [(name, dtype, shape, nbytes) for _, name, dtype, shape, nbytes in entries]


def layout(arrays: dict[str, np.ndarray]) -> dict:
    """What a file of these arrays holds ({"tensors": {name: (code, shape)}, "aliases", "data_bytes"})."""
    unique, aliases = split_aliases(arrays)
    tensors = {k: (_code(a), tuple(a.shape)) for k, a in unique.items()}
    return dict(tensors=tensors, aliases=aliases, data_bytes=sum(a.nbytes for a in unique.values()))


def _layout_reason(entries, aliases: dict, expect: dict) -> str | None:
    got = {name: (FROM_NUMPY[dtype], shape) for name, dtype, shape, _ in entries}
    want = expect["tensors"]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        said = [f"{w} {n[:5]}" for w, n in (("lacks", missing), ("has unexpected", extra)) if n]
        return "tensors differ from what the config builds: " + "; ".join(said)
    for name in sorted(want):
        if got[name] != want[name]:
            (gc, gs), (wc, ws) = got[name], want[name]
            return f"{name} is {gc}{list(gs)}, the config builds {wc}{list(ws)}"
    if aliases != expect["aliases"]:
        return f"tied names {aliases} differ from the config's {expect['aliases']}"
    return None


def read_tensors(
    path: Path, expected_sha256: str | None = None, expect: list[dict] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays (aliases one object) and metadata, read and hashed in one pass; DigestMismatch first, else ValueError
    for a file that is not safetensors or (given `layout`s to `expect`) holds other tensors, before any is read."""
    with reading.open_file(path) as f, _Hasher() as h:
        size = os.fstat(f.fileno()).st_size
        most = max(e["data_bytes"] for e in expect) if expect else 0
        if expect and size > 8 + MAX_HEADER + most:
            why = f"{size} bytes, more than a checkpoint of this config can hold ({most} bytes of tensors)"
            raise ValueError(why)
        arrays: dict[str, np.ndarray] = {}
        problem: _Malformed | None = None
        try:
            if size < 8:
                raise _Malformed(f"{size} bytes: too short for a safetensors header")
            (n,) = struct.unpack("<Q", _read_exact(f, memoryview(bytearray(8)), h))
            if n > MAX_HEADER:
                raise _Malformed(f"header of {n} bytes is over the {MAX_HEADER}-byte limit")
            if n > size - 8:
                raise _Malformed(f"header length {n} does not fit a {size}-byte file")
            raw = _read_exact(f, memoryview(bytearray(n)), h)
            try:
                header = jsonio.loads(bytes(raw))
            except jsonio.JSONError as e:
                raise _Malformed(f"header: {e}") from None
            metadata, entries = _check_header(header, size - 8 - n)
            links = {k: m.group(1) for k, v in metadata.items() if (m := ALIAS.match(v))}
            reasons = [_layout_reason(entries, links, e) for e in expect or []]
            # the nearest's: one naming a tensor over one naming the set
            if reasons and all(reasons):
                nearest = min(map(str, reasons), key=lambda r: r.startswith("tensors differ"))
                raise LayoutMisfit(nearest)
            for name, dtype, shape, nbytes in entries:
                a = np.empty(shape, dtype=dtype)
                for i in range(0, nbytes, CHUNK):
                    _read_exact(f, _bytes_of(a)[i : i + CHUNK], h)
                arrays[name] = a if dtype.isnative else a.astype(dtype.newbyteorder("="))
            if f.read(1):
                raise _Malformed("the file grew while it was read")
        except _Malformed as e:
            # Integrity first: hash the rest, so a damaged file is reported as damaged, not as malformed.
            while rest := f.read(CHUNK):
                h.update(rest)
            problem = e
        digest = h.hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        why = f"sha256 {digest[:16]}... differs from the expected {expected_sha256[:16]}..."
        raise DigestMismatch(why)
    if problem is not None:
        misfit = isinstance(problem, LayoutMisfit)
        what = "does not fit" if misfit else "not a valid safetensors file"
        raise type(problem)(f"{what}: {problem}")
    # each ALIAS(target) the very object stored under target, sorted: one file, one message whatever its order
    for name in sorted(links):
        if name in arrays:
            raise ValueError(f"{name} is both stored and declared an alias")
        chain, target = [name], links[name]
        while target in links:  # follow chains, refusing loops
            if target in chain:
                raise ValueError(f"circular alias {' -> '.join([*chain, target])}")
            chain.append(target)
            target = links[target]
        if target not in arrays:
            raise ValueError(f"alias {name} -> {links[name]} names no stored tensor")
        arrays[name] = arrays[target]  # never an alias's name: a chain ends at a stored one
    return arrays, metadata
