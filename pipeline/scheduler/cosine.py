"""Cosine decay after a linear warmup, as transformers' get_cosine_schedule_with_warmup (a LambdaLR)."""

import math

from pipeline.scheduler.base import Scheduler


class WarmupCosine(Scheduler):
    def __init__(self, optimizer, total_steps: int | None, warmup_steps: int, warmup_offset: int,
                 min_lr_ratio: float, num_cycles: float, run_total_steps: int | None = None):  # fmt: skip
        total_steps = total_steps if total_steps is not None else run_total_steps
        if total_steps is None or total_steps < 1 or warmup_steps < 0:
            got = f"got {total_steps}, {warmup_steps}"
            raise ValueError(f"scheduler needs total_steps >= 1 and warmup_steps >= 0, {got}")
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)
        self.warmup_offset = int(warmup_offset)
        self.min_lr_ratio, self.num_cycles = float(min_lr_ratio), float(num_cycles)
        super().__init__(optimizer)

    def lr_at(self, k: int) -> float:
        # warm-up offset 0: HF's k / warmup (the first update at 0); 1: nanoGPT's (k + 1) / (warmup + 1)
        if k < self.warmup_steps:
            w = self.warmup_offset
            return self.base_lr * (k + w) / max(1, self.warmup_steps + w)
        progress = (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * progress)))
        return self.base_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)
