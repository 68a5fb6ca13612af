"""Value checks for schema fields: each takes a value and returns None, or what is allowed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable


def _finite(v) -> bool:  # an int of any size is: math.isfinite overflows past a float's range
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, int) and not isinstance(v, bool)


def at_least(lo, null: bool = False) -> Callable:
    why = f"must be {'null or ' if null else ''}a number >= {lo}"
    return lambda v: None if (null and v is None) or (_finite(v) and v >= lo) else why


def above(lo) -> Callable:
    return lambda v: None if _finite(v) and v > lo else f"must be a finite number > {lo}"


def fraction(v) -> str | None:
    return None if _finite(v) and 0 <= v < 1 else "must be in [0, 1)"


def open_fraction(v) -> str | None:
    return None if _finite(v) and 0 < v < 1 else "must be in (0, 1)"


def probability_list(v) -> str | None:
    ok = isinstance(v, list) and len(v) == 2 and all(fraction(x) is None for x in v)
    return None if ok else "must be two numbers in [0, 1)"


def widths(v) -> str | None:
    ok = isinstance(v, list) and all(isinstance(x, int) and x >= 1 for x in v)
    return None if ok else "must be a list of layer widths >= 1"


DURATION = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_duration(text: str) -> float:
    """'DD:HH:MM:SS' (Lightning's max_time format) -> seconds; ValueError saying the format otherwise."""
    m = DURATION.match(str(text).strip())
    if not m or int(m.group(2)) > 23 or int(m.group(3)) > 59 or int(m.group(4)) > 59:
        why = "must be DD:HH:MM:SS (e.g. 00:03:50:00), hours < 24, minutes and seconds < 60"
        raise ValueError(why)
    total = sum(int(g) * unit for g, unit in zip(m.groups(), (86400, 3600, 60, 1)))
    if total <= 0:
        raise ValueError("must be a positive duration (null turns the budget off)")
    return float(total)


def duration_or_null(v) -> str | None:
    try:
        if v is not None:
            parse_duration(v)
    except ValueError as e:
        return str(e)
    return None
