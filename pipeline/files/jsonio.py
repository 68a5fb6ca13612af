"""Standard JSON (RFC 8259) in and out: non-finite floats as strings, strict and bounded on reading."""

from __future__ import annotations

import hashlib
import json
import math
from types import MappingProxyType
from typing import Any

from pipeline.files import reading
from pipeline.files.limits import MAX_JSON_DEPTH

# Python writes NaN bare, not JSON; we write protobuf's JSON mapping for floats instead (read-only).
NON_FINITE = MappingProxyType({"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf})


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
    """A metric value as `dumps` wrote it (a number or a NON_FINITE string) as a float; else JSONError."""
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
    form: dict[str, Any] = dict(separators=(",", ":")) if canonical else dict(indent=indent)
    text = json.dumps(_finite(obj), sort_keys=True, ensure_ascii=False, allow_nan=False, **form)
    return text.encode() if canonical else (text + "\n").encode()


def digest(obj) -> str:
    """sha256 hex of the canonical form: every hash of a config or a history in this project."""
    return hashlib.new("sha256", dumps(obj, canonical=True)).hexdigest()


def dumps_line(obj) -> str:
    """One JSON Lines record (no newline)."""
    return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)


def _too_deep(obj) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            if d > MAX_JSON_DEPTH:
                return True
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return False


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
    """Standard JSON, strictly (a checkpoint must mean the same to every reader); else a one-line JSONError."""
    try:
        strict: dict[str, Any] = dict(parse_constant=_reject_constant, object_pairs_hook=_unique)
        obj = json.loads(data, parse_float=_float, parse_int=_int, **strict)
    except RecursionError:
        raise JSONError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise JSONError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if _too_deep(obj):
        raise JSONError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return obj


def read(path, limit: int):
    """A bounded JSON file, parsed strictly; its JSONError names the file (`<path>: duplicate key 'x' ...`)."""
    try:
        return loads(reading.read_bytes(path, limit))
    except JSONError as e:
        raise JSONError(f"{path}: {e}") from None


def flatten(tree, sep: str = ".", prefix: str = "") -> dict:
    """Every leaf of a nested dict (an empty dict is one) by its `sep`-joined path."""
    if isinstance(tree, dict) and tree:
        flat = (flatten(v, sep, f"{prefix}{k}{sep}") for k, v in tree.items())
        return {path: leaf for one in flat for path, leaf in one.items()}
    return {prefix[: -len(sep)]: tree} if prefix else {}
