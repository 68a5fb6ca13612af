"""What a person watching sees: a tqdm bar on a terminal, plain log lines otherwise."""
from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger("pipeline")


class Display:
    def __init__(self, enabled: bool | None, log_every: int):
        self.bar_enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.log_every = max(1, int(log_every))
        self.bar = None

    def on_train_start(self, state) -> None:
        if self.bar_enabled:
            self.bar = tqdm(total=state.total_steps, initial=state.step, desc="train", dynamic_ncols=True)

    def on_step_end(self, state, record: dict) -> None:
        val = {k: v for k, v in record.items() if k.startswith("val/")}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['train/loss']:.4f}", lr=f"{record['lr']:.3g}", refresh=False)
            if val:
                self.bar.write(f"step {record['step']}: " + " ".join(f"{k}={v:.4f}" for k, v in val.items()))
        elif record["step"] % self.log_every == 0 or val or record["step"] == state.total_steps:
            extra = "".join(f" {k}={v:.4f}" for k, v in val.items())
            log.info("step %d/%d epoch %d loss=%.6f lr=%.6g%s", record["step"], state.total_steps,
                     record["epoch"], record["train/loss"], record["lr"], extra)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
