"""The one comparator of "the same state" (the verifier's summaries, roundtrip's state trees)."""

from __future__ import annotations

import json

import numpy as np

from pipeline.stateful import PARTS, flat

MISSING = object()
# The state machine of a key's first part ("eval": the model's), or of a per-update record after the cut.
MACHINE_OF = {**{p: p for p in PARTS}, "eval": "model", "records/loss": "model"}
MACHINE_OF |= {"records/ids": "data_iter", "records/step": "data_iter", "records/lr": "scheduler"}


def diff(a, b, atol: float = 0.0, rtol: float = 0.0) -> dict:
    """{'max_abs_diff', 'ok', 'detail'} for two leaves: exact is the same bytes; a tolerance loosens arrays only."""
    if a is MISSING or b is MISSING:
        return _result(False, "missing on one side")
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        same = type(a) is type(b) and _json(a) == _json(b)
        return _result(same, "" if same else f"{_json(a)} vs {_json(b)}")
    if a.shape != b.shape or a.dtype != b.dtype:
        return _result(False, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    if a.size == 0:
        return _result(True, max_abs_diff=0.0)
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(fa) & np.isfinite(fb)
    if not finite.all():
        return _result(False, f"{int((~finite).sum())} non-finite values")
    d = np.abs(fa - fb)
    ok = bool(np.all(d <= atol + rtol * np.abs(fb))) if atol or rtol else a.tobytes() == b.tobytes()
    return _result(ok, max_abs_diff=float(d.max()))


def _result(ok: bool, detail: str = "", max_abs_diff: float | None = None) -> dict:
    return {"max_abs_diff": max_abs_diff, "ok": ok, "detail": detail}


def _json(v) -> str:
    # floats by their shortest repr, which round-trips (so differing bits differ); never a bare == on floats
    return json.dumps(v, sort_keys=True, default=repr)


def compare(reference: dict, other: dict, atol: float = 0.0, rtol: float = 0.0) -> dict[str, dict]:
    """Every key of either side, compared; a key on one side only is a structural difference."""
    keys = sorted(set(reference) | set(other))
    return {k: diff(reference.get(k, MISSING), other.get(k, MISSING), atol, rtol) for k in keys}


def first_difference(a, b, name: str = "") -> str | None:
    """Where two state trees (or two arrays) first differ, exactly, as "<path>: <why>"; None if they do not."""
    for key, r in compare(flat({name: a} if name else a), flat({name: b} if name else b)).items():
        if not r["ok"]:
            return f"{key}: {r['detail'] or 'values differ, by up to ' + repr(r['max_abs_diff'])}"
    return None


def machine(key: str) -> str:
    return MACHINE_OF.get(key) or MACHINE_OF[key.split("/", 1)[0]]
