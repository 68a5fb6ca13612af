"""The state protocol: every part's state_dict() as one tree (arrays to safetensors, the rest to JSON), and a
two-phase restore that changes nothing unless every part fits. A part may add `check_state_dict(state)`
(ValueError for impossible values) and `free_form_state` (paths of objects whose keys vary, left to that check)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import numpy as np

from pipeline.files.jsonio import flatten

# The state machines of a run, in restore order: RNG streams last, so nothing drawn restoring the others disturbs them.
PARTS = ("model", "optimizer", "scheduler", "data_iter", "progress", "stages", "rng")
SEP = "/"


class StateMismatch(ValueError):
    """A saved state that does not fit the live part; `path`: the keys below the part to the value at fault."""

    def __init__(self, part: str, reason: str, path: tuple = ()):
        self.part, self.reason, self.path = part, reason, tuple(path)
        super().__init__(f"{part}: {reason}")


class BadValue(ValueError):
    """A part's check_state_dict refusing one value: `key` (keys below the part) lets the reader name its file."""

    def __init__(self, key: str | tuple, reason: str):
        self.key = (key,) if isinstance(key, str) else tuple(key)
        super().__init__(reason)


def capture(parts: Mapping, only: tuple[str, ...] = PARTS) -> dict[str, dict]:
    """{part: state_dict}: the live arrays, not copies (copy_tree keeps them)."""
    return {name: parts[name].state_dict() for name in only}


def copy_tree(tree):
    """A deep copy in which every array is an independent C-contiguous copy."""
    if isinstance(tree, np.ndarray):
        return np.array(tree, order="C", copy=True)
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    return [copy_tree(v) for v in tree] if isinstance(tree, list) else tree


def split(tree: dict) -> tuple[dict[str, np.ndarray], dict]:
    """Arrays by path ("optimizer/exp_avg/h.0.w") and the tree without them; JSON keys may hold SEP (train/loss)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node: dict, path: tuple) -> dict:
        out = {}
        for k, v in node.items():
            if isinstance(v, np.ndarray):
                keys = (*path, k)
                if not all(isinstance(p, str) and p and SEP not in p for p in keys):
                    why = "keys on the way to an array must be non-empty strings without"
                    raise ValueError(f"array {keys}: {why} {SEP!r}")
                arrays[SEP.join(keys)] = v
            else:
                out[k] = walk(v, (*path, k)) if isinstance(v, dict) else v
        return out

    return arrays, walk(tree, ())


def merge(arrays: Mapping[str, np.ndarray], json_tree: dict) -> dict:
    """The inverse of split: arrays put back at their paths (missing dicts created)."""
    tree = copy_tree(json_tree)
    for path, a in arrays.items():
        *parents, leaf = path.split(SEP)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                why = "which is not an object in the JSON state"
                raise ValueError(f"array {path!r} sits under {p!r}, {why}")
        if leaf in node:
            raise ValueError(f"{path!r} is both an array and a JSON value")
        node[leaf] = a
    return tree


# bool before int: a bool is an int
_KINDS: dict[type, str] = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str"}
_KINDS |= {list: "list", dict: "object", np.ndarray: "array"}


def _json_kind(v) -> str:
    return next((name for kind, name in _KINDS.items() if isinstance(v, kind)), type(v).__name__)


def _where(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f"{SEP}{p}" if out else str(p))
    return out or "(top)"


def misfit(live, got, path: tuple = (), free: tuple[str, ...] = ()) -> tuple[tuple, str] | None:
    """(the keys to the value at fault, why) if `got` cannot replace the live state `live` (same keys, array
    shapes/dtypes, JSON kinds), else None. Paths in `free` ("/"-joined) are only checked to be objects."""
    where, kind, got_kind = _where(path), _json_kind(live), _json_kind(got)
    if kind in ("object", "array", "list") and got_kind != kind:
        return path, f"{where}: expected {'a' if kind == 'list' else 'an'} {kind}, got {got_kind}"
    if kind == "object":
        if SEP.join(map(str, path)) in free:  # "" frees the part's top level
            return None
        missing, extra = sorted(set(live) - set(got)), sorted(set(got) - set(live))
        if missing or extra:
            said = [f"lacks {missing[:5]}"] if missing else []
            said += [f"has unexpected {extra[:5]}"] if extra else []
            why = f"{where}: keys differ: the saved state " + " and ".join(said)
            return (*path, (missing or extra)[0]), why
        return next(filter(None, (misfit(live[k], got[k], (*path, k), free) for k in live)), None)
    if kind == "array":
        if got.shape != live.shape or got.dtype != live.dtype:
            why = f"saved {got.dtype}{list(got.shape)}, the live run has {live.dtype}{list(live.shape)}"
            return path, f"{where}: {why}"
        return None
    if kind == "list":
        if len(live) != len(got):
            return path, f"{where}: a list of {len(got)}, the live run has {len(live)}"
        pairs = enumerate(zip(live, got))
        return next(filter(None, (misfit(a, b, (*path, i)) for i, (a, b) in pairs)), None)
    # A fresh part has null where a trained one has a value (no best metric yet), and an int where JSON may
    # hold a float written without a fraction; anything else must be the same kind.
    if kind != got_kind and "null" not in (kind, got_kind) and {kind, got_kind} != {"int", "float"}:
        return path, f"{where}: expected {kind}, got {got_kind}"
    return None


def check(parts: Mapping, tree: Mapping, only: tuple[str, ...] = PARTS) -> None:
    """Raise StateMismatch naming the first part whose saved state would not fit; changes nothing."""
    for name in only:
        if name not in tree:
            raise StateMismatch(name, "missing from the saved state")
        part, saved = parts[name], tree[name]
        if found := misfit(part.state_dict(), saved, free=getattr(part, "free_form_state", ())):
            raise StateMismatch(name, found[1], found[0])
        try:
            if (own := getattr(part, "check_state_dict", None)) is not None:
                own(saved)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
            raise StateMismatch(name, str(e) or type(e).__name__, getattr(e, "key", ())) from None


def restore(parts: Mapping, tree: Mapping, only: tuple[str, ...] = PARTS) -> None:
    """Check every part, then load every part (in PARTS order); nothing changes unless all fit."""
    only = tuple(p for p in PARTS if p in only)
    check(parts, tree, only)
    for name in only:
        parts[name].load_state_dict(tree[name])


# every leaf by "/"-joined path (arrays and JSON values alike), for reports and comparisons
flat = partial(flatten, sep=SEP)
