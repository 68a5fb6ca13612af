"""What a person watching sees: a tqdm bar on a terminal, plain log lines otherwise; throughput in both."""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline.trainer.metrics_log import is_logged

log = logging.getLogger("pipeline")

WINDOW = 20  # updates the throughput is measured over (the recent rate, not the run's average)


class Throughput:
    """Updates/s and samples (or tokens)/s over the last WINDOW step ends (evaluations and checkpoints included)."""

    def __init__(self, per_update: int, unit: str, window: int = WINDOW):
        self.per_update, self.unit = int(per_update), unit
        self.ends: collections.deque = collections.deque(maxlen=window + 1)

    def step(self, now: float) -> None:
        """An update ended at `now` (the first call: the start)."""
        self.ends.append(now)

    def rates(self) -> tuple[float, float] | None:
        """(updates/s, units/s), or None before the first update."""
        if len(self.ends) < 2 or self.ends[-1] <= self.ends[0]:
            return None
        per_s = (len(self.ends) - 1) / (self.ends[-1] - self.ends[0])
        return per_s, per_s * self.per_update

    def text(self) -> str:
        r = self.rates()
        return "" if r is None else f"{_si(r[0])} steps/s {_si(r[1])} {self.unit}/s"


def _si(x: float) -> str:
    div, suffix = next(((d, s) for d, s in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if x >= d), (1, ""))
    return f"{x / div:.3g}{suffix}"


class Display:
    def __init__(self, enabled: bool | None, log_every: int):
        self.bar_enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.bar, self.log_every, self.redirect = None, int(log_every), contextlib.ExitStack()
        self.speed: Throughput | None = None

    def on_train_start(self, state) -> None:
        samples = state.iterator.batch_size * state.accumulate
        block = state.dataset.spec.block_size if state.dataset.spec.vocab_size else 0
        self.speed = Throughput(samples * (block or 1), "tokens" if block else "samples")
        self.speed.step(time.perf_counter())
        if self.bar_enabled:
            b = tqdm(total=state.total_steps, initial=state.step, desc="train", dynamic_ncols=True)
            self.bar = self.redirect.enter_context(b)  # closed by close()
            # Log lines while the bar shows (validation, mlflow's thread) go above it by tqdm.write, never into it.
            self.redirect.enter_context(logging_redirect_tqdm([logging.getLogger()]))

    def on_step_end(self, state, record: dict) -> None:
        assert self.speed is not None, "on_train_start comes first"
        where = f"step {record['step']}/{state.total_steps} epoch {record['epoch']}"
        val = "".join(f" {k}={v:.4f}" for k, v in record.items() if k.startswith("val/"))
        if "train/loss" not in record:  # the evaluation before the first update
            return log.info("%s%s", where, val)
        self.speed.step(time.perf_counter())
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{record['train/loss']:.4f}", "lr": f"{record['lr']:.3g}"}
            if (rates := self.speed.rates()) is not None:
                post["tok/s" if self.speed.unit == "tokens" else "samples/s"] = _si(rates[1])
            self.bar.set_postfix(post, refresh=False)
        # with the bar: evaluations
        if is_logged(record, 0 if self.bar else self.log_every, state.total_steps):
            speed = f" ({text})" if (text := self.speed.text()) else ""
            loss, lr = record["train/loss"], record["lr"]
            log.info("%s loss=%.6f lr=%.6g%s%s", where, loss, lr, val, speed)

    def close(self) -> None:
        self.bar = None
        self.redirect.close()
