"""Learning-rate schedules: the lr each update uses, and the scheduler state round trip."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from pipeline.optimizer.adam import Adam
from pipeline.optimizer.sgd import SGD
from pipeline.scheduler.constant import Constant
from pipeline.scheduler.cosine import WarmupCosine
from pipeline.scheduler.step import StepLR

PLAIN = {
    SGD: dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
    Adam: dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, weight_decay_on="all"),
}  # torch.optim's defaults


def optimizer(lr: float, cls=SGD):
    return cls({"w": np.array([1.0, -2.0])}, lr=lr, **PLAIN[cls])


def lrs_used(opt, sched, n: int) -> list[float]:
    """The lr read by updates 1..n when the loop is: optimizer.step(); scheduler.step()."""
    out = []
    for _ in range(n):
        out.append(opt.lr)
        opt.step({"w": np.array([0.1, 0.2])})
        sched.step()
    return out


def test_step_lr_sequence():
    opt = optimizer(0.03)
    got = lrs_used(opt, StepLR(opt, step_size=3, gamma=0.5), 11)
    expected = [0.03, 0.03, 0.03, 0.015, 0.015, 0.015, 0.0075, 0.0075, 0.0075, 0.00375, 0.00375]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert got[9] == pytest.approx(0.00375, rel=1e-12) and got[10] == pytest.approx(
        0.00375, rel=1e-12
    )


def test_step_lr_rejects_step_size_below_one():
    with pytest.raises(ValueError, match=r"scheduler.step_size must be >= 1, got 0"):
        StepLR(optimizer(0.1), step_size=0, gamma=0.5)


def hf_cosine_with_warmup(base_lr, step, warmup, total, num_cycles=0.5, min_lr_rate=0.0):
    """transformers.get_cosine_schedule_with_warmup's lr_lambda (and, with min_lr_rate, the
    get_cosine_with_min_lr_schedule_with_warmup variant), times the base lr; step = updates taken so far."""
    if step < warmup:
        return base_lr * float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))
    return base_lr * (factor * (1 - min_lr_rate) + min_lr_rate)


@pytest.mark.parametrize(
    "warmup,total,num_cycles,min_lr",
    [
        (5, 20, 0.5, 0.0),
        (0, 12, 0.5, 0.0),
        (3, 17, 0.5, 0.1),
        (4, 16, 1.0, 0.0),
        (1, 2, 0.5, 0.0),
    ],
)
def test_cosine_with_warmup_matches_transformers_formula(warmup, total, num_cycles, min_lr):
    opt = optimizer(0.1)
    sched = WarmupCosine(
        opt,
        total_steps=total,
        warmup_steps=warmup,
        warmup_offset=0,
        num_cycles=num_cycles,
        min_lr_ratio=min_lr,
    )
    got = lrs_used(opt, sched, total)
    expected = [
        hf_cosine_with_warmup(0.1, k, warmup, total, num_cycles, min_lr) for k in range(total)
    ]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-18)
    # after the last update the schedule is at its floor (or back at the start of a cycle for num_cycles=1)
    assert opt.lr == pytest.approx(
        hf_cosine_with_warmup(0.1, total, warmup, total, num_cycles, min_lr), abs=1e-15
    )


def test_cosine_shape():
    opt = optimizer(0.1)
    got = lrs_used(
        opt,
        WarmupCosine(
            opt, total_steps=20, warmup_steps=5, warmup_offset=0, min_lr_ratio=0.0, num_cycles=0.5
        ),
        20,
    )
    assert got[0] == 0.0  # transformers' warmup starts at 0
    assert got[:6] == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08, 0.1], rel=1e-12, abs=0)
    assert all(
        a > b for a, b in itertools.pairwise(got[5:])
    )  # strictly decreasing after the warmup
    assert opt.lr == pytest.approx(0.0, abs=1e-18)


def nanogpt_lr(it: int, lr=1e-3, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4) -> float:
    """nanoGPT's train.py get_lr, transcribed."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (lr - min_lr)


def test_a_warmup_offset_of_one_is_nanogpts_schedule_whose_first_update_moves():
    opt = optimizer(1e-3)
    sched = WarmupCosine(
        opt, total_steps=2000, warmup_steps=100, warmup_offset=1, min_lr_ratio=0.1, num_cycles=0.5
    )
    got = lrs_used(opt, sched, 2000)
    assert got[0] == pytest.approx(
        1e-3 / 101, rel=1e-15
    )  # not 0: the first update moves the weights
    assert got == pytest.approx([nanogpt_lr(k) for k in range(2000)], rel=1e-12, abs=0)


def test_cosine_total_steps_defaults_to_the_runs_total():
    opt = optimizer(0.1)
    sched = WarmupCosine(
        opt,
        total_steps=None,
        warmup_steps=2,
        warmup_offset=0,
        min_lr_ratio=0.0,
        num_cycles=0.5,
        run_total_steps=10,
    )
    assert sched.total_steps == 10
    got = lrs_used(opt, sched, 10)
    assert got == pytest.approx(
        [hf_cosine_with_warmup(0.1, k, 2, 10) for k in range(10)], rel=1e-12, abs=1e-18
    )
    with pytest.raises(
        ValueError, match="scheduler needs total_steps >= 1 and warmup_steps >= 0, got None, 2"
    ):
        WarmupCosine(
            optimizer(0.1),
            total_steps=None,
            warmup_steps=2,
            warmup_offset=0,
            min_lr_ratio=0.0,
            num_cycles=0.5,
            run_total_steps=None,
        )


def test_constant():
    opt = optimizer(0.07, Adam)
    assert lrs_used(opt, Constant(opt), 25) == [0.07] * 25
    assert opt.lr == 0.07


SCHEDULERS = [
    pytest.param(lambda o: StepLR(o, step_size=3, gamma=0.5), id="step"),
    pytest.param(
        lambda o: WarmupCosine(
            o, total_steps=15, warmup_steps=4, warmup_offset=0, min_lr_ratio=0.05, num_cycles=0.5
        ),
        id="cosine",
    ),
    pytest.param(lambda o: Constant(o), id="constant"),
]


@pytest.mark.parametrize("make", SCHEDULERS)
@pytest.mark.parametrize("k", [0, 2, 4, 7])
def test_scheduler_state_round_trip_continues_the_sequence(make, k):
    uninterrupted_opt = optimizer(0.03)
    expected = lrs_used(uninterrupted_opt, make(uninterrupted_opt), 14)

    opt = optimizer(0.03)
    sched = make(opt)
    assert lrs_used(opt, sched, k) == expected[:k]
    sched_state = json.loads(
        json.dumps(sched.state_dict())
    )  # what a checkpoint stores: the counter only
    assert sched_state == {"last_epoch": k}

    fresh_opt = optimizer(0.03)
    fresh = make(fresh_opt)
    fresh_opt.lr = 123.0  # whatever it was: loading the scheduler sets the lr the next update uses
    fresh.load_state_dict(sched_state)
    assert (
        fresh.last_epoch == k
        and fresh.state_dict() == sched.state_dict()
        and fresh_opt.lr == opt.lr
    )
    assert lrs_used(fresh_opt, fresh, 14 - k) == expected[k:]


@pytest.mark.parametrize("make", SCHEDULERS)
def test_a_new_base_lr_takes_effect_from_the_restored_step(make):
    """resume.allow_changes=[optimizer.lr]: the counter comes from the checkpoint, the base lr from the config."""
    opt = optimizer(0.03)
    sched = make(opt)
    lrs_used(opt, sched, 5)
    fresh_opt = optimizer(0.05)
    fresh = make(fresh_opt)
    fresh.load_state_dict(sched.state_dict())
    other_opt = optimizer(0.05)
    expected = lrs_used(other_opt, make(other_opt), 9)[5:]  # the lr=0.05 schedule from update 5 on
    assert lrs_used(fresh_opt, fresh, 4) == expected
