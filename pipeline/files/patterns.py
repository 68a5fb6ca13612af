"""A name made from a pattern and a checkpoint's values (`{step}-{val/loss:.3f}`), checked as one path component."""

from __future__ import annotations

import math
import re
import string
from pathlib import Path

from pipeline.files import atomic, names

# `step`, or a metric's name (val/loss, or val_loss): a plain name, never an attribute (`.`) or an index (`[`)
FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_/-]{0,63}$")
# A number's format spec, bounded: [sign][#][0][width<=99][,_][.precision<=20][type]
SPEC = re.compile(r"^[+ -]?#?0?(\d{1,2})?[,_]?(\.(\d{1,2}))?[deEfFgG%]?$")
MAX_PRECISION = 20
WIDE = 24  # characters of one value past which it is written `.6g` (1e+300 rather than 301 digits)
STEP_LIKE = re.compile(r"^step-\d")  # a step directory's name, never a link's
TEMPORARY = len(atomic.temp_name(Path("x")).name) - 1  # bytes a link's temporary name adds (18)


def problem(pattern) -> str | None:
    """Why `pattern` cannot name checkpoints, or None."""
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty string such as '{step}-{val/loss:.3f}'"
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as e:
        return f"is not a format pattern ({e})"
    fields = [(f, spec or "", conv) for _, f, spec, conv in parsed if f is not None]
    for f, spec, conv in fields:
        if conv is not None or not FIELD.match(f) or "{" in spec or not SPEC.match(spec):
            shown = f"{{{f}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
            why = "a number format such as .3f (a plain name: no attribute, index or conversion)"
            return f"field {shown} is not a metric or step with {why}"
        if (m := SPEC.match(spec)) and m.group(3) and int(m.group(3)) > MAX_PRECISION:
            return f"field {{{f}:{spec}}}: at most {MAX_PRECISION} digits"
    if any(f == "step" and not re.match(r"^[+ -]?0?\d{0,2}d?$", spec) for f, spec, _ in fields):
        return "{step} takes an integer format only (such as {step:06d}): two steps must never share a name"
    if "step" not in {f for f, _, _ in fields}:
        return "must contain {step} (the step is what tells two checkpoints apart)"
    widest = "".join(text + ("x" * WIDE if f is not None else "") for text, f, _, _ in parsed)
    longest = len(widest.encode())
    if longest > (most := names.NAME_MAX - TEMPORARY):
        why = f"a file name holds {names.NAME_MAX} bytes, with the {TEMPORARY} of a link's temporary name"
        return f"makes names of up to {longest} bytes (each field up to {WIDE} characters); at most {most} ({why})"
    zeros = {f: 0.0 for f, _, _ in fields}
    if render(pattern, 0, zeros) is None:
        example = _text(pattern, 0, zeros)
        why = "which cannot name a link beside the step directories (not step-<digits>, not hidden, one path component)"
        return f"makes {names.shown(example)}, {why}"
    return None


def metric_fields(pattern: str) -> list[str]:
    """The metrics a valid pattern names, each as written (`val_loss` or `val/loss`), `step` left out."""
    return [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None and f != "step"]


def spellings(field: str) -> tuple[str, str]:
    """The metric names a field may stand for: itself, or with '/' for '_' (Lightning's val_loss for val/loss)."""
    return field, field.replace("_", "/")


def _one(value, spec: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    try:
        text = format(value, spec)
    except (ValueError, TypeError):  # a float given `d`: the value as it is, shortly
        text = format(float(value), ".6g")
    return text if len(text) <= WIDE else format(float(value), ".6g")


def render(pattern: str, step: int, metrics: dict) -> str | None:
    """The name `pattern` gives a checkpoint of `step` with these metrics, or None if not one path component."""
    name = _text(pattern, step, metrics)
    refused = names.problem(name, reserve=TEMPORARY) or STEP_LIKE.match(name) or name[:1] == "."
    return None if refused else name


def _text(pattern: str, step: int, metrics: dict) -> str:
    out = []
    for literal, field, spec, _ in string.Formatter().parse(pattern):
        out.append(literal)
        if field is not None:
            mine, lightning = spellings(field)
            value = step if field == "step" else metrics.get(mine, metrics.get(lightning))
            out.append(_one(value, spec or ""))
    return "".join(out)
