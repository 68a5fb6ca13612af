"""metrics.jsonl: one JSON object per logged step, appended and flushed as the run goes; pipeline.log's handler."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TextIO

from pipeline.files import atomic, jsonio

LOGGED = ("train/loss", "train/ppl", "lr", "grad_norm", "clipped")


def is_logged(record: dict, log_every: int, total_steps: int) -> bool:
    """A step with a line (metrics.jsonl's; the log's without the bar): it evaluated, is the last or a log_every'th."""
    step, evaluated = record["step"], any(k.startswith("val/") for k in record)
    return evaluated or step == total_steps or (log_every > 0 and step % log_every == 0)


class MetricsLog:
    """A trainer callback appending log lines to a run's metrics.jsonl; `sinks` get each line too."""

    def __init__(self, open_file, log_every: int, sinks: list | None = None):
        self.open_file, self.log_every, self.sinks = open_file, int(log_every), list(sinks or [])
        self.file: TextIO | None = None

    def on_train_start(self, state) -> None:
        self.file = self.open_file()

    def on_step_end(self, state, record: dict) -> None:
        if not is_logged(record, self.log_every, state.total_steps):
            return
        line = {"step": record["step"], "epoch": record["epoch"], "time": time.time()}
        line.update({k: record[k] for k in LOGGED if k in record})
        line.update({k: v for k, v in record.items() if k.startswith("val/")})
        assert self.file is not None, "on_train_start comes first"
        try:
            self.file.write(jsonio.dumps_line(line) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: the run fails naming the file (a torn last line is dropped on resume)
            raise atomic.named(e, self.file.name) from e
        for sink in self.sinks:
            sink(line)

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            with contextlib.suppress(OSError):  # the failed write raised already, naming the file
                file.close()


class QuietFileHandler(logging.StreamHandler):
    """pipeline.log: a failing stream (a full disk) is kept in `error`, never written again, no traceback (a record)."""

    error: BaseException | None = None  # the first failure, set on the instance

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.error = sys.exc_info()[1]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.close()
        super().close()
