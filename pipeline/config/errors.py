"""Every exit code, the errors that carry one (CommandError), and exit_code(): the one map from an error to its code."""

from __future__ import annotations

import difflib

# Every entry point's exit codes (docs/stages.md: Exit codes): done, an error, bad input, preempted (re-run it)
EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_PREEMPTED = 0, 1, 2, 75
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: SLURM could not be reached (no client here, or no controller answered): re-run


class CommandError(Exception):
    """An error a command ends with: its one line (str) and its exit code (the class's, or the one given)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, *args, exit_code: int | None = None):
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(CommandError, ValueError):
    """A config value out of range, or groups that do not go together (one line per problem)."""


class Refusal(BaseException):
    """A CommandError carried through code that makes a warning of every Exception (Hydra's callbacks)."""

    def __init__(self, error: CommandError):
        super().__init__(str(error))
        self.error = error


def exit_code(e: BaseException) -> tuple[int, str] | None:
    """(code, one line) for an error a command ends with, ours or a library's; None: a bug, left to its traceback."""
    from pipeline.files.atomic import UnsafePathError, environment_error

    e = e.error if isinstance(e, Refusal) else e
    if isinstance(e, CommandError):
        return e.exit_code, str(e)
    if isinstance(e, UnsafePathError):
        return EXIT_BAD_INPUT, str(e)
    if (message := environment_error(e)) is not None:  # a full or read-only disk
        return EXIT_ERROR, message
    if (message := slurm_unreachable(e)) is not None:
        return EXIT_UNAVAILABLE, message
    if type(e).__module__.split(".")[0] in ("hydra", "omegaconf", "yaml"):
        return EXIT_BAD_INPUT, f"bad config or override: {error_line(e)}"
    return None


def slurm_unreachable(e: BaseException) -> str | None:
    """One line if `e` says no SLURM client is here (submitit) or `sbatch` could not reach its controller; else None."""
    import re
    import subprocess

    if isinstance(e, RuntimeError) and str(e).startswith('Could not detect "srun"'):
        return "SLURM could not be reached: no SLURM client (srun, sbatch) on this machine"
    cause = e.__cause__
    sbatch = isinstance(cause, subprocess.CalledProcessError) and str(cause.cmd[0]) == "sbatch"
    unreached = r"contact slurm controller|configuration source|timed out|zero bytes"
    if sbatch and re.search(unreached, str(e), re.I):
        said = [line for line in str(e).splitlines() if line.strip()]
        return f"SLURM could not be reached: {said[-1].strip()}; nothing was submitted, re-run once it answers"
    return None


def error_line(e: BaseException) -> str:
    """A composition error as one line: Hydra's message, its cause, the key at fault, a group's options."""
    parts = [str(e).strip().splitlines()[0].rstrip(".:")] if str(e).strip() else [type(e).__name__]
    cause = e.__cause__ or e.__context__
    said = str(cause).strip() if cause is not None else ""
    if said and (first := said.splitlines()[0].rstrip(".:")) not in parts:
        parts.append(first)
    override = getattr(e, "override", None)  # an override Hydra's grammar cannot read
    if isinstance(override, str) and override:
        name, _, value = override.partition("=")
        quoted = f"\"{name}='{value}'\"" if value and not set(value) & set("'\"$`\\!") else "it"
        return f"{override}: {parts[0]}; if the value is text, quote it for Hydra inside the shell's quotes: {quoted}"
    key = getattr(e, "full_key", None) or getattr(cause, "full_key", None)
    line = ": ".join(parts) + (f" (key {key})" if key and key not in " ".join(parts) else "")
    # hydra's MissingConfigException: the group's options, if it has any, and the closest (model/minigtp)
    options, missing = getattr(e, "options", None), getattr(e, "missing_cfg_file", None)
    group, _, name = str(missing or "").rpartition("/")
    if options:
        where = f" in '{group}'" if group else ""
        line += f"; available options{where}: {', '.join(options)}"
    if options and missing:
        found = difflib.get_close_matches(name, [str(o) for o in options], n=1)
        return line + (f"; did you mean {group}={found[0]}?" if found and group else "")
    return line + closest(cause)


def closest(cause: BaseException | None) -> str:
    """`; did you mean X?` for an unknown key (difflib's closest of its node's); "" if nothing is close."""
    from pipeline.config.compose import CONFIG_DIR

    node, key, full = (getattr(cause, a, None) for a in ("parent_node", "key", "full_key"))
    if not isinstance(key, str) or not isinstance(full, str) or not hasattr(node, "keys"):
        return ""
    keys = [str(k) for k in node.keys()]  # type: ignore[union-attr]  # noqa: SIM118 - an OmegaConf node or a dict
    if key in keys:  # a key that is there (its value was wrong): nothing to suggest
        return ""
    # a stage that is off unless added: the options of the shipped group conf/stages/<key>/ (early_stop: default)
    stage = full == f"stages.{key}" and key.isidentifier()
    if stage and (added := sorted(p.stem for p in (CONFIG_DIR / "stages" / key).glob("*.yaml"))):
        return f"; stage {key} is off unless added: add {' or '.join(f'+stages/{key}={o}' for o in added)}"
    found = difflib.get_close_matches(key, [k for k in keys if k != "hydra"], n=1)
    prefix = full[: -len(key)] if full.endswith(key) else ""
    return f"; did you mean {prefix}{found[0]}?" if found else ""
