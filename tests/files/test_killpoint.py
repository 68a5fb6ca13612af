"""The chaos mode's kill points (pipeline/files/killpoint.py)."""

from __future__ import annotations


def test_the_kill_points_read_the_environment_at_the_first_point_not_on_import(
    tmp_path, monkeypatch
):
    """No import-time state (#31): a chaos plan set after the import is the one that holds."""
    import importlib

    from pipeline.files import killpoint

    killpoint = importlib.reload(killpoint)
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("PIPELINE_CHAOS_TRACE", str(trace))
    killpoint.point("save", "after weights")
    killpoint.point("save", "after optim")
    assert trace.read_text() == "save 1 after weights\nsave 2 after optim\n"
    importlib.reload(killpoint)  # the next test's process state: none
