"""ARCHITECTURE.md stays true: every file it names exists, and its layer diagram names every unit of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "ARCHITECTURE.md").read_text()


def test_every_file_it_names_exists():
    named = set(re.findall(r"`(pipeline/[\w/]+\.py)`", TEXT))
    short = {
        f"pipeline/{p}"
        for p in re.findall(
            r"`((?:cli|config|files|run|checkpoint|stages|tracking|trainer|"
            r"verify|model|data)/\w+\.py)",
            TEXT,
        )
    }
    assert len(named | short) > 20
    assert [p for p in sorted(named | short) if not (ROOT / p).is_file()] == []


def test_the_layer_diagram_names_every_unit_of_the_package():
    diagram = TEXT.split("## The layers", 1)[1].split("```")[1]
    units = {
        p.name for p in (ROOT / "pipeline").iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    units |= {p.stem for p in (ROOT / "pipeline").glob("*.py") if p.stem != "__init__"}
    assert [
        u for u in sorted(units) if not re.search(rf"(^|\s){re.escape(u)}(/|\.py|\s)", diagram)
    ] == []
