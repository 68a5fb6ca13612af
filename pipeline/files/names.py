"""The one check of a name that becomes a path component: a run's, a sweep's, a step's, a registered model's."""

from __future__ import annotations

import unicodedata

NAME_MAX = 255  # bytes of one file name (NAME_MAX on Linux and macOS)
# Bytes the pipeline may add to a name it is given: a run's `-<12 hex>`, a fresh run's `-<date>-<time>-<6 hex>`,
# a sweep's `-<12 hex>`, and a temporary's `.tmp-` ... `-<12 hex>` around the whole.
SUFFIX_BYTES = 64
SHOWN = 80  # characters of a refused value's repr in its one line


class BadName(ValueError):
    """A name that cannot be one path component (one line: what, its value, why)."""


def shown(value: object) -> str:
    """The value's repr, cut to about SHOWN characters: a refusal stays one short line whatever it was given."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[: SHOWN - 3]}..."


def problem(value: object, reserve: int = SUFFIX_BYTES) -> str | None:
    """Why `value` cannot name one entry of a directory (with `reserve` bytes of suffixes added), or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string (it names a directory)"
    if "/" in value:
        return "must not contain '/' (it names one directory, never a path)"
    if value in (".", ".."):
        return "must not be '.' or '..' (it names a directory of its own)"
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in value):
        return "must not contain control characters (a newline, a tab, NUL...)"
    size = len(value.encode("utf-8", "surrogateescape"))
    if size > NAME_MAX - reserve:
        why = f"is {size} bytes; at most {NAME_MAX - reserve}"
        said = f" (a file name holds {NAME_MAX} bytes, with the {reserve} the pipeline may add)"
        return why + said if reserve else why
    return None


def checked(value: object, what: str, reserve: int = SUFFIX_BYTES) -> str:
    """`value` if it can be one path component; BadName `<what>=<value>: <why>` otherwise."""
    if (why := problem(value, reserve)) is not None:
        raise BadName(f"{what}={shown(value)}: {why}")
    assert isinstance(value, str)  # problem() refuses every non-string
    return value
