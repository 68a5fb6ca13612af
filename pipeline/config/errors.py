"""What a bad config is (ConfigError), how a composition error reads in one line, and every exit code."""
from __future__ import annotations

import sys

# Every entry point's exit codes (docs/stages.md: Exit codes): 0 done, 1 an error in the job, 2 bad input (nothing
# started or changed), 75 preempted or interrupted (EX_TEMPFAIL: re-run the same command to resume).
EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_PREEMPTED = 0, 1, 2, 75


def refuse(tool: str, message: object) -> int:
    """The one line a tool prints for bad input (`tool: message` on stderr); EXIT_BAD_INPUT, for main to return."""
    print(f"{tool}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


class ConfigError(ValueError):
    """A config value out of range, or groups that do not go together (one line per problem)."""


def error_line(e: BaseException) -> str:
    """A composition error as one line: Hydra's message, its cause, the key at fault, and for an unknown
    option of a group the options there are (Hydra lists them on lines of their own)."""
    parts = [str(e).strip().splitlines()[0].rstrip(".:")] if str(e).strip() else [type(e).__name__]
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0].rstrip(".:"))
    key = getattr(e, "full_key", None) or getattr(cause, "full_key", None)
    line = ": ".join(parts) + (f" (key {key})" if key and key not in " ".join(parts) else "")
    options = getattr(e, "options", None)  # hydra's MissingConfigException: the group's options, if it has any
    missing = getattr(e, "missing_cfg_file", None)
    if options:
        where = f" in '{missing.rsplit('/', 1)[0]}'" if missing and "/" in missing else ""
        line += f"; available options{where}: {', '.join(options)}"
    return line + closest(e, cause)


def closest(e: BaseException, cause: BaseException | None) -> str:
    """`; did you mean X?` for an unknown key (the closest of its node's keys) or an unknown option of a group (the
    closest of its options), by difflib's similarity; "" if nothing is close."""
    import difflib

    options, missing = getattr(e, "options", None), getattr(e, "missing_cfg_file", None)
    if options and missing:  # model/minigtp
        group, _, name = str(missing).rpartition("/")
        found = difflib.get_close_matches(name, [str(o) for o in options], n=1)
        return f"; did you mean {group}={found[0]}?" if found and group else ""
    node, key, full = (getattr(cause, a, None) for a in ("parent_node", "key", "full_key"))
    if not isinstance(key, str) or not isinstance(full, str) or not hasattr(node, "keys"):
        return ""
    found = difflib.get_close_matches(key, [str(k) for k in node.keys() if k != "hydra"], n=1)
    prefix = full[:-len(key)] if full.endswith(key) else ""
    return f"; did you mean {prefix}{found[0]}?" if found else ""
