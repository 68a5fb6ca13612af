"""The step loop: one batch, one forward and backward, one optimizer update, one scheduler step."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.files import killpoint
from pipeline.trainer.parallel import owned
from pipeline.trainer.phases import OFF, Profile
from pipeline.trainer.state import TrainState

NOT_METRICS = ("step", "epoch", "ids", "step_time")  # ids: the verifier's; step_time: wall, unsaved


# Metric names beside the code measuring them: a config's monitors and optimized_metric are checked against them.
def counts_tokens(data) -> bool:
    """A dataset (class or instance) of token sequences: its losses also have a perplexity (train/ppl, val/ppl)."""
    return getattr(data, "kind", None) == "tokens"


def train_metric_names(data, grad_clip: float) -> tuple[str, ...]:
    """The metrics of train_step's record: every update's."""
    clipped, tokens = ("clipped",) * (grad_clip > 0), ("train/ppl",) * counts_tokens(data)
    return ("train/loss", "lr", "grad_norm", *clipped, *tokens)


def val_metric_names(data) -> tuple[str, ...]:
    """The metrics validate() measures: an evaluation's (the data's `baselines`: what its baseline_metrics gives)."""
    return ("val/loss", *("val/ppl",) * counts_tokens(data), *getattr(data, "baselines", ()))


def kept(name: str) -> bool:
    """A metric the run keeps as its latest value (state.metrics: run.json, what optimized_metric reads)."""
    return "/" in name


def grad_norm(grads: dict[str, np.ndarray]) -> float:
    """The global L2 norm over every gradient array (a Python float: accumulated in double precision)."""
    return math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))


def clip(grads: dict[str, np.ndarray], norm: float, max_norm: float) -> bool:
    """PyTorch's clip_grad_norm_ in place: times max_norm / (norm + 1e-6) if < 1 (True); a non-finite norm untouched"""
    coef = max_norm / (norm + 1e-6)
    if not math.isfinite(norm) or coef >= 1.0:
        return False
    for g in grads.values():
        g *= coef  # a Python float: the arrays keep their dtype
    return True


def validate(state: TrainState) -> dict[str, float]:
    """Mean validation loss over the first trainer.eval_batches (None: all) fixed validation batches, by batch size."""
    batches = itertools.islice(state.dataset.val_batches(state.dtype), state.eval_batches)
    loss = state.runner.mean_loss(state.model, batches)
    ppl = {"val/ppl": _ppl(loss)} if counts_tokens(state.dataset) else {}
    return {"val/loss": loss, **ppl, **state.dataset.baseline_metrics()}


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def epochs_done(state: TrainState) -> int:
    """Epochs whose every batch has been used (this one too if the next batch would not fit: drop_last)."""
    it = state.iterator
    return it.epoch + int(it.cursor + it.batch_size > it.n)


def train_step(state: TrainState, profile: Profile = OFF) -> dict:
    """One update from trainer.accumulate micro-batches, never cut by a checkpoint; its record. Loss and gradient
    are their means, (g_0 + ... + g_{N-1}) * (1/N) in order, clipped after the mean (`grad_norm`: before)."""
    epoch = epochs_done(state)  # the epoch the update's first micro-batch comes from
    lr, ids, loss, grads = state.optimizer.lr, [], 0.0, None
    data, dropout = state.dataset, state.streams["dropout"]
    for _ in range(state.accumulate):
        with profile.phase("data"):
            batch_ids = state.iterator.next_ids()
            batch = data.augment(data.train_batch(batch_ids, state.dtype), state.streams)
        with profile.phase("forward/backward"):
            piece_loss, piece_grads = state.runner.loss_and_grads(state.model, batch, dropout)
            ids.append(batch_ids)
            loss += piece_loss
            if grads is None:
                grads = owned(piece_grads)
            else:
                for name, g in grads.items():
                    g += piece_grads[name]
    assert grads is not None  # accumulate >= 1 pieces
    if state.accumulate > 1:
        with profile.phase("forward/backward"):
            loss /= state.accumulate
            for g in grads.values():
                g *= 1.0 / state.accumulate
    killpoint.point("train", "after backward")
    with profile.phase("optimizer"):
        gnorm = grad_norm(grads)
        state.progress.clipped += int(state.grad_clip > 0 and clip(grads, gnorm, state.grad_clip))
        state.optimizer.step(grads)
        killpoint.point("train", "after optimizer step")
        state.scheduler.step()
    state.progress.step += 1
    values = {"train/loss": loss, "lr": lr, "grad_norm": gnorm, "clipped": state.progress.clipped}
    values["train/ppl"] = _ppl(loss)
    record: dict[str, Any] = {"step": state.step, "epoch": epoch}
    record.update((k, values[k]) for k in train_metric_names(data, state.grad_clip))
    record["ids"] = ids[0] if len(ids) == 1 else np.concatenate(ids)
    return record


def metrics_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in NOT_METRICS}


def fit(
    state: TrainState, eval_every: int, on_step_end: Callable, callbacks, profile: Profile = OFF
) -> None:
    """Steps until the budget is spent or on_step_end (the run's decision) is True, evaluating every `eval_every`
    updates (0: each epoch's end) and at the last; callbacks see each record first (step 0's evaluation: only they)."""
    for cb in callbacks:
        getattr(cb, "on_train_start", lambda s: None)(state)
    # step 0's evaluation (trainer.eval_at_start; a resumed run is past it)
    record: dict = {"step": 0, "epoch": 0} if state.eval_at_start and state.step == 0 else {}
    while record or state.step < state.total_steps:
        if not record:
            t0 = time.perf_counter()
            with np.errstate(all="ignore"):  # an overflow: one non-finite metric the run reports
                record = train_step(state, profile) if profile.on else train_step(state)
            record["step_time"] = time.perf_counter() - t0
        ended = epochs_done(state) > record["epoch"]  # in this update (maybe mid-group)
        due = state.step % eval_every == 0 if eval_every > 0 else ended
        if due or state.step >= state.total_steps or state.step == 0:
            with np.errstate(all="ignore"), profile.phase("evaluation"):
                record.update(validate(state))
        state.progress.metrics.update({k: v for k, v in record.items() if kept(k)})
        for cb in callbacks:
            cb.on_step_end(state, record)
        if state.step > 0 and on_step_end(record):
            return
        record = {}
