"""Every reader of a sweep's records takes the direction sweep.json recorded (best-val's mode at the sweep's
start); a record without one is refused in one sentence naming the file, never read as "minimize"."""

from __future__ import annotations

import pytest

from pipeline.sweep.summary import SweepRecordError, best_job, sweep_table
from pipeline.tracking.index import objective_points, parent_tags

SWEEP = {
    "id": "0123456789ab",
    "name": "kernodeck",
    "swept": {"optimizer.lr": "0,1,2"},
    "dir": "/o/sweeps/s",
    "objective": "best/val/loss",
    "status": "complete",
    "started": 1.0,
}
JOBS = {
    n: {
        "num": n,
        "name": f"optimizer.lr={n}",
        "overrides": [f"optimizer.lr={n}"],
        "objective": v,
        "status": "complete",
    }
    for n, v in {0: 0.5, 1: 0.2, 2: 0.9}.items()
}

READERS = {
    "best_job": lambda sweep: best_job(JOBS, sweep),
    "sweep_table": lambda sweep: sweep_table(sweep, JOBS, None, ["p"]),
    "objective_points": lambda sweep: objective_points(sweep, JOBS),
    "parent_tags": lambda sweep: parent_tags(
        None, sweep, JOBS
    ),  # no store reached: no best run_dir to look up
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(
    "recorded", [{}, {"direction": None}, {"direction": "min"}], ids=["without", "null", "other"]
)
def test_a_sweep_record_without_a_direction_is_refused_by_every_reader(reader, recorded):
    with pytest.raises(
        SweepRecordError, match=r"^/o/sweeps/s/sweep\.json: direction=.*: not minimize or maximize"
    ):
        READERS[reader]({**SWEEP, **recorded})


def test_every_reader_follows_the_recorded_direction():
    for direction, best, points in (
        ("minimize", 1, [0.5, 0.2, 0.2]),
        ("maximize", 2, [0.5, 0.5, 0.9]),
    ):
        sweep = {**SWEEP, "direction": direction}
        assert best_job(JOBS, sweep)["num"] == best
        assert parent_tags(None, sweep, JOBS)[0]["best.job"] == str(best)
        assert [p[1] for p in objective_points(sweep, JOBS)] == points
        assert sweep_table(sweep, JOBS, best_job(JOBS, sweep), ["p"])[0].endswith(
            f"best/val/loss ({direction[:3]})"
        )
