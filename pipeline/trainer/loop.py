"""The step loop: one batch, one forward and backward, one optimizer update, one scheduler step."""
from __future__ import annotations

import math
import time

import numpy as np

from pipeline import chaos
from pipeline.trainer.state import RunState


class StopTraining(Exception):
    """Raised by a callback to end the loop after the current step (e.g. on a preemption signal)."""


def grad_norm(grads: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))


def evaluate(state: RunState) -> dict[str, float]:
    """Mean validation loss over the fixed validation batches, weighted by batch size."""
    total, count = 0.0, 0
    for batch in state.dataset.val_batches(state.dtype):
        n = len(batch.ids)
        total += state.model.evaluate(batch) * n
        count += n
    loss = total / count
    out = {"val/loss": loss}
    if getattr(state.dataset, "spec", None) is not None and state.dataset.spec.vocab_size:
        out["val/ppl"] = math.exp(min(loss, 700.0))
    out.update(state.dataset.baseline_metrics())
    return out


def train_step(state: RunState) -> dict:
    """One update; returns its record (what the verifier compares: ids, lr, loss)."""
    epoch = state.iterator.epoch + end_of_epoch(state)  # the epoch this batch comes from
    ids = state.iterator.next_ids()
    batch = state.dataset.augment(state.dataset.train_batch(ids, state.dtype), state.streams)
    lr = state.optimizer.lr
    loss, grads = state.model.loss_and_grads(batch, state.streams["dropout"])
    chaos.point("train", "after backward")
    gnorm = grad_norm(grads)
    state.optimizer.step(grads)
    chaos.point("train", "after optimizer step")
    state.scheduler.step()
    state.step += 1
    record = {"step": state.step, "epoch": epoch, "train/loss": loss, "lr": lr, "grad_norm": gnorm}
    if state.dataset.spec.vocab_size:
        record["train/ppl"] = math.exp(min(loss, 700.0))
    record["ids"] = ids
    return record


def end_of_epoch(state: RunState) -> bool:
    it = state.iterator
    return it.cursor + it.batch_size > it.n


class Trainer:
    """Runs steps until total_steps, calling callbacks; evaluation every eval_every steps (0: each epoch)."""

    def __init__(self, eval_every: int = 0, callbacks: list | None = None):
        self.eval_every = int(eval_every)
        self.callbacks = list(callbacks or [])

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)

    def fit(self, state: RunState) -> None:
        self._emit("on_train_start", state)
        try:
            while state.step < state.total_steps:
                t0 = time.perf_counter()
                record = train_step(state)
                record["step_time"] = time.perf_counter() - t0
                last = state.step >= state.total_steps
                epoch_done = end_of_epoch(state)
                due = (self.eval_every > 0 and state.step % self.eval_every == 0) or (self.eval_every <= 0 and epoch_done)
                if due or last:
                    record.update(evaluate(state))
                state.metrics.update({k: v for k, v in record.items() if "/" in k})
                self._emit("on_step_end", state, record)
                if epoch_done:
                    self._emit("on_epoch_end", state, record)
        except StopTraining:
            self._emit("on_train_stop", state)
            raise
        self._emit("on_train_end", state)
