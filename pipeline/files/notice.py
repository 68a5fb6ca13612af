"""A line for the person at the terminal: through logging where it is configured, else on a terminal's stderr."""
from __future__ import annotations

import logging
import sys


def notice(log: logging.Logger, message: str) -> None:
    """`message` once: as an INFO record when `log` reaches a handler (a run: Hydra's console and the run's
    log), else on stderr if it is a terminal (the tools that configure no logging, where an INFO record would
    be dropped). Not on a pipe: there stderr carries only a refusal's one line, which scripts read."""
    if log.hasHandlers():
        log.info(message)
    elif sys.stderr is not None and sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)
