"""The step loop: one batch, one forward and backward, one optimizer update, one scheduler step."""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from pipeline import killpoint
from pipeline.trainer.state import TrainState

# Record keys that are not metrics: the verifier compares `ids`; `step_time` is wall time (never saved).
NOT_METRICS = ("step", "epoch", "ids", "step_time")


def grad_norm(grads: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))


def evaluate(state: TrainState) -> dict[str, float]:
    """Mean validation loss over the fixed validation batches, weighted by batch size."""
    total, count = 0.0, 0
    for batch in state.dataset.val_batches(state.dtype):
        n = len(batch.ids)
        total += state.model.evaluate(batch) * n
        count += n
    loss = total / count
    out = {"val/loss": loss}
    if state.dataset.spec.vocab_size:
        out["val/ppl"] = math.exp(min(loss, 700.0))
    out.update(state.dataset.baseline_metrics())
    return out


def end_of_epoch(state: TrainState) -> bool:
    """True when the next batch would not fit in what is left of this epoch (drop_last)."""
    it = state.iterator
    return it.cursor + it.batch_size > it.n


def train_step(state: TrainState) -> dict:
    """One update; returns its record (what the verifier compares: ids, lr, loss)."""
    epoch = state.iterator.epoch + end_of_epoch(state)  # the epoch this batch comes from
    ids = state.iterator.next_ids()
    batch = state.dataset.augment(state.dataset.train_batch(ids, state.dtype), state.streams)
    lr = state.optimizer.lr
    loss, grads = state.model.loss_and_grads(batch, state.streams["dropout"])
    killpoint.point("train", "after backward")
    gnorm = grad_norm(grads)
    state.optimizer.step(grads)
    killpoint.point("train", "after optimizer step")
    state.scheduler.step()
    state.progress.step += 1
    record = {"step": state.step, "epoch": epoch, "train/loss": loss, "lr": lr, "grad_norm": gnorm}
    if state.dataset.spec.vocab_size:
        record["train/ppl"] = math.exp(min(loss, 700.0))
    record["ids"] = ids
    return record


def metrics_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in NOT_METRICS}


def fit(state: TrainState, eval_every: int, on_step_end: Callable[[dict], bool], callbacks: list) -> None:
    """Steps until the budget is spent or on_step_end (the run's decision: checkpoint, stop) returns True.

    Evaluates every `eval_every` updates (0: at the end of every epoch) and always at the last update;
    callbacks see each record (on_train_start, on_step_end, close) before the run decides on it.
    """
    for cb in callbacks:
        getattr(cb, "on_train_start", lambda s: None)(state)
    while state.step < state.total_steps:
        t0 = time.perf_counter()
        with np.errstate(all="ignore"):  # an overflow is reported once, by the run, as a non-finite metric
            record = train_step(state)
        record["step_time"] = time.perf_counter() - t0
        last = state.step >= state.total_steps
        epoch_done = end_of_epoch(state)
        due = state.step % eval_every == 0 if eval_every > 0 else epoch_done
        if due or last:
            with np.errstate(all="ignore"):
                record.update(evaluate(state))
        state.progress.metrics.update({k: v for k, v in record.items() if "/" in k})
        for cb in callbacks:
            cb.on_step_end(state, record)
        if on_step_end(record):
            return
