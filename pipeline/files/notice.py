"""A line for the person at the terminal: through logging where it is configured, else on a terminal's stderr."""
from __future__ import annotations

import logging
import sys


def notice(log: logging.Logger, message: str) -> None:
    """`message` as an INFO record where `log` reaches a handler, else on stderr if a terminal: never on a pipe,
    where stderr carries only a refusal's one line, which scripts read."""
    if log.hasHandlers():
        log.info(message)
    elif sys.stderr is not None and sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)
