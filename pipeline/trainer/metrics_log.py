"""metrics.jsonl: one JSON object per logged step, appended and flushed as the run goes."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

LOGGED = ("train/loss", "train/ppl", "lr", "grad_norm")


def log_line(record: dict) -> dict:
    line = {"step": record["step"], "epoch": record["epoch"], "time": time.time()}
    line.update({k: record[k] for k in LOGGED if k in record})
    line.update({k: v for k, v in record.items() if k.startswith("val/")})
    return line


def is_logged(record: dict, log_every: int, total_steps: int) -> bool:
    step = record["step"]
    has_val = any(k.startswith("val/") for k in record)
    return has_val or step == total_steps or (log_every > 0 and step % log_every == 0)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            break  # a torn last line from a killed process: everything before it is good
    return lines


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines up to `step` (a resume point), atomically: a resumed run appends from there."""
    if not path.exists():
        return
    kept = [line for line in read_metrics(path) if line["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """A trainer callback appending log lines to <run dir>/metrics.jsonl; `sinks` get each line too."""

    def __init__(self, path: Path, log_every: int, sinks: list | None = None):
        self.path, self.log_every, self.sinks = Path(path), int(log_every), list(sinks or [])
        self.file = None

    def on_train_start(self, state) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")

    def on_step_end(self, state, record: dict) -> None:
        if not is_logged(record, self.log_every, state.total_steps):
            return
        line = log_line(record)
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    on_train_end = on_train_stop = lambda self, state: self.close()
