"""Standard JSON (RFC 8259) in and out: non-finite floats as strings, bounded size and nesting on reading.

Python's json writes NaN and Infinity bare, which is not JSON (strict parsers reject the file). Every JSON
file the pipeline writes goes through `dumps`, which writes a non-finite float as the string "NaN",
"Infinity" or "-Infinity" (protobuf's JSON mapping for floats); `number` reads such a value back exactly.
Reading is strict, as a checkpoint must mean the same to every reader: `loads` refuses a duplicate key
(Python keeps the last, other parsers the first), a number out of range (`1e999`, which Python reads as
inf; an integer longer than Python converts), bare NaN/Infinity, nesting deeper than MAX_DEPTH; `read`
refuses anything but a regular file and a file over a size limit before reading it (pipeline.files.reading), and names the file in its error.
"""
from __future__ import annotations

import json
import math
from types import MappingProxyType

from pipeline.files import reading

MAX_DEPTH = 64
NON_FINITE = MappingProxyType({"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf})  # read-only


class JSONError(ValueError):
    """A JSON file that is too big, too deep, not JSON, or not the shape asked for (one line: the reason)."""


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def number(v) -> float:
    """A metric value as written by `dumps` (a number, or one of the NON_FINITE strings) back to a float;
    JSONError for anything else, and for an integer too large for a float."""
    if isinstance(v, str) and v in NON_FINITE:
        return NON_FINITE[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise JSONError(f"{v!r:.80} is not a number")
    try:
        return float(v)
    except OverflowError:
        raise JSONError(f"{str(v)[:40]}... is out of range for a float") from None


def dumps(obj, *, indent: int | None = 2, canonical: bool = False) -> bytes:
    """UTF-8 bytes of standard JSON; canonical=True is the hashing form (sorted keys, no spaces)."""
    if canonical:
        text = json.dumps(_finite(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode()
    text = json.dumps(_finite(obj), sort_keys=True, indent=indent, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode()


def dumps_line(obj) -> str:
    """One JSON Lines record (no newline)."""
    return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)


def _depth(obj) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _reject_constant(name: str):
    raise JSONError(f"contains {name}, which is not JSON")


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise JSONError(f"duplicate key {k!r:.80} (readers disagree on which value counts)")
            seen.add(k)
    return out


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise JSONError(f"number {text:.40} is out of range (overflows a 64-bit float)")
    return x


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # longer than sys.get_int_max_str_digits()
        raise JSONError(f"integer {text[:20]}... of {len(text)} digits is out of range") from None


def loads(data: bytes | str):
    """Parse standard JSON strictly; JSONError (a ValueError, one line) for anything else: bare NaN, a
    duplicate key, a number out of range, bad UTF-8, too deep."""
    try:
        obj = json.loads(data, parse_constant=_reject_constant, object_pairs_hook=_unique, parse_float=_float,
                         parse_int=_int)
    except RecursionError:
        raise JSONError(f"nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise JSONError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if _depth(obj) > MAX_DEPTH:
        raise JSONError(f"nested deeper than {MAX_DEPTH} levels")
    return obj


def read_bytes(path, limit: int) -> bytes:
    """A regular file's bytes (pipeline.files.reading.read_bytes): a symlink, a FIFO, a device, a socket, a
    directory or more than `limit` bytes is refused before anything is read or could block, with a
    reading.UnreadableFile (an OSError) naming the path and the reason."""
    return reading.read_bytes(path, limit)


def read(path, limit: int):
    """A bounded JSON file, parsed strictly; its JSONError names the file (`<path>: duplicate key 'x' ...`)."""
    try:
        return loads(read_bytes(path, limit))
    except JSONError as e:
        raise JSONError(f"{path}: {e}") from None


def flatten(tree, sep: str = ".", prefix: str = "") -> dict:
    """Every leaf of a nested dict by its `sep`-joined path; empty dicts (and anything not a dict) are
    leaves. Config keys for mlflow params and drift reports (`.`), state paths (`/`)."""
    if isinstance(tree, dict) and tree:
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        return out
    return {prefix[: -len(sep)]: tree} if prefix else {}
