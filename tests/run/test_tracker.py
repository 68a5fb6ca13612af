"""The tracker a job's `tracking` node builds (pipeline/run/tracker.py)."""
from __future__ import annotations


def test_the_tracker_is_told_the_sweep_job_it_tracks(tmp_path):
    from pipeline.run.sweep import SweepJob
    from pipeline.run.tracker import tracker_for

    job = SweepJob(dir=tmp_path, sweep_id="abc", num=1, parent={"sweep_id": "abc"})
    tracking = {"_target_": "pipeline.tracking.mlflow_tracker.MlflowTracker", "uri": f"sqlite:///{tmp_path}/m.db",
                "experiment": "e", "artifact_location": None, "wait": 1.0}
    tracker = tracker_for({"tracking": tracking}, job)
    assert tracker.parent == {"sweep_id": "abc"} and tracker.job["num"] == 1
    assert tracker_for({"tracking": tracking}).parent is None
    assert type(tracker_for({"tracking": None}, job)).__name__ == "Tracker"  # no node: the no-op protocol
