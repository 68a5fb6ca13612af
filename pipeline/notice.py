"""A line for the person at the terminal: through logging where it is configured, else straight to stderr."""
from __future__ import annotations

import logging
import sys


def notice(log: logging.Logger, message: str) -> None:
    """`message` once: as an INFO record when `log` reaches a handler (a run: Hydra's console and the run's
    log), else on stderr (the tools that configure no logging, where an INFO record would be dropped)."""
    if log.hasHandlers():
        log.info(message)
    else:
        print(message, file=sys.stderr, flush=True)
