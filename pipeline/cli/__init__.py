"""The command-line tools, each run as `python -m pipeline TOOL` (or `python -m pipeline.TOOL`, pipeline/__init__)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def parser(name: str, doc: str | None, **kw) -> argparse.ArgumentParser:
    """A tool's parser: `python -m NAME`, described by its docstring's first paragraph."""
    description = (doc or "").split("\n\n")[0]
    return argparse.ArgumentParser(prog=f"python -m {name}", description=description, **kw)


def emit(result: dict, as_json: bool, render: Callable[[dict], str]) -> None:
    """A tool's result printed: as JSON (`--json`), else as its lines."""
    from pipeline.files import jsonio

    print(jsonio.dumps(result).decode() if as_json else render(result), end="" if as_json else "\n")


def metrics_line(metrics) -> str:
    """`key=value ...` sorted, numbers to 6 significant digits; "-" for none."""
    if not isinstance(metrics, dict) or not metrics:
        return "-"
    items = sorted(metrics.items())
    return " ".join(f"{k}={v:.6g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in items)


def temporaries(root) -> list[str]:
    """The names of the leftovers of interrupted writes in directory `root` (none if it is not one)."""
    from pipeline.files.atomic import TMP_PREFIX

    return sorted(
        p.name for p in (root.iterdir() if root.is_dir() else ()) if p.name.startswith(TMP_PREFIX)
    )
