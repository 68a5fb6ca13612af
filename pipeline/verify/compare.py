"""Pure comparisons of two summaries: max abs difference, non-finite values and structure, per state machine."""
from __future__ import annotations

import json

import numpy as np

MACHINE_OF = {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler", "data_iter": "data_iter",
              "rng": "rng", "eval": "model"}
# Per-update records after the cut, and which state machine a mismatch there points at first.
RECORDS = {"records/ids": "data_iter", "records/lr": "scheduler", "records/loss": "model", "records/step": "data_iter"}


def diff(a, b, atol: float, rtol: float) -> dict:
    """{'max_abs_diff', 'ok', 'detail'} for two arrays; structure and non-finite values are failures."""
    if a is None or b is None:
        return {"max_abs_diff": None, "ok": False, "detail": "missing on one side"}
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"max_abs_diff": None, "ok": False, "detail": f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"}
    if a.size == 0:
        return {"max_abs_diff": 0.0, "ok": True, "detail": ""}
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(fa) & np.isfinite(fb)
    if not finite.all():
        return {"max_abs_diff": None, "ok": False, "detail": f"{int((~finite).sum())} non-finite values"}
    d = np.abs(fa - fb)
    ok = bool(np.all(d <= atol + rtol * np.abs(fb))) if (atol or rtol) else bool(np.array_equal(a, b))
    return {"max_abs_diff": float(d.max()), "ok": ok, "detail": ""}


def compare(reference: dict, other: dict, atol: float, rtol: float, keys: list[str] | None = None) -> dict[str, dict]:
    """Every key of either side, compared; a key on one side only is a structural difference."""
    names = sorted(set(reference) | set(other)) if keys is None else keys
    return {k: diff(reference.get(k), other.get(k), atol, rtol) for k in names}


def json_equal(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def machine(key: str) -> str:
    return RECORDS.get(key) or MACHINE_OF[key.split("/", 1)[0]]
