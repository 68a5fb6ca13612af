"""The tracker a job's `tracking` node builds (pipeline/run/assemble.py build_tracker, the protocol of
pipeline/run/tracker.py)."""

from __future__ import annotations


def test_the_tracker_is_told_the_sweep_job_it_tracks(tmp_path):
    from pipeline.run.assemble import build_tracker
    from pipeline.run.sweep import SweepJob

    job = SweepJob(dir=tmp_path, sweep_id="abc", num=1, parent={"sweep_id": "abc"})
    tracking = {
        "_target_": "pipeline.tracking.mlflow_tracker.MlflowTracker",
        "uri": f"sqlite:///{tmp_path}/m.db",
        "experiment": "e",
        "artifact_location": None,
        "wait": 1.0,
    }
    tracker = build_tracker({"tracking": tracking}, job)
    assert tracker.parent == {"sweep_id": "abc"} and tracker.job["num"] == 1
    assert build_tracker({"tracking": tracking}).parent is None
    assert (
        type(build_tracker({"tracking": None}, job)).__name__ == "Tracker"
    )  # no node: the no-op protocol


OWN_TRACKER = """
from pipeline.run.tracker import Tracker


class OwnTracker(Tracker):
    def __init__(self, wait: float = 1.0):
        self.wait = wait
"""


def test_a_tracker_of_your_own_need_not_take_the_sweep_job_and_a_key_it_does_not_take_is_refused(
    tmp_path, monkeypatch
):
    import pytest

    from pipeline.config.errors import ConfigError
    from pipeline.run.assemble import build_tracker
    from pipeline.run.sweep import SweepJob

    (tmp_path / "own_tracking.py").write_text(OWN_TRACKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = SweepJob(dir=tmp_path, sweep_id="abc", num=1, parent={"sweep_id": "abc"})
    assert (
        build_tracker({"tracking": {"_target_": "own_tracking.OwnTracker", "wait": 2.0}}, job).wait
        == 2.0
    )
    with pytest.raises(ConfigError, match=r"own_tracking\.OwnTracker takes no argument 'wiat'"):
        build_tracker({"tracking": {"_target_": "own_tracking.OwnTracker", "wiat": 2.0}})
