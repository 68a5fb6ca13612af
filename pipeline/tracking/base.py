"""The null tracker (tracking=none): the run's tracker protocol, doing nothing."""
from __future__ import annotations

from pipeline.run.tracker import Tracker


class NullTracker(Tracker):
    def __init__(self, **_):
        pass
