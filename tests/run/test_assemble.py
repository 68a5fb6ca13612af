"""The job object (pipeline/run/assemble.py): seed 003 (experiment=kernodeck) built from the composed config, the
objects and their first updates; nothing past the door holds a DictConfig."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import config_of

from pipeline.config import identity
from pipeline.model.mlp import MLP
from pipeline.optimizer.adam import Adam, AdamW
from pipeline.run.assemble import assemble
from pipeline.run.job import build
from pipeline.run.tracker import Tracker
from pipeline.scheduler.step import StepLR
from pipeline.stages.base import StageStates
from pipeline.stateful import PARTS
from pipeline.trainer.loop import train_step


@pytest.fixture
def kernodeck(tmp_path):
    return config_of("experiment=kernodeck", "tracking=none", f"paths.output_dir={tmp_path}")


def build_state(config):
    return build(config).state


def test_kernodeck_builds_seed_003(kernodeck):
    state = build_state(kernodeck)
    model = state.model
    assert type(model) is MLP
    shapes = {k: v.shape for k, v in model.params.items()}
    assert shapes == {
        "layers.0.weight": (2, 8),
        "layers.0.bias": (8,),
        "layers.1.weight": (8, 1),
        "layers.1.bias": (1,),
    }
    assert sum(p.size for p in model.params.values()) == 33  # 2*8 + 8 + 8*1 + 1
    assert model.dropout == 0.25
    assert state.dtype == np.float64 and all(p.dtype == np.float64 for p in model.params.values())
    opt = state.optimizer
    assert type(opt) is Adam and not isinstance(opt, AdamW)
    assert opt.lr == 0.03 and (opt.beta1, opt.beta2, opt.eps, opt.weight_decay) == (
        0.9,
        0.999,
        1e-8,
        0.0,
    )
    # the optimizer updates the model's live arrays, held in a plain dict (nothing past build sees a DictConfig)
    assert type(opt.params) is dict and list(opt.params) == list(model.params)
    assert all(opt.params[k] is p for k, p in model.params.items())
    sched = state.scheduler
    assert type(sched) is StepLR and (sched.step_size, sched.gamma, sched.base_lr) == (3, 0.5, 0.03)
    assert (state.iterator.n, state.iterator.batch_size, state.iterator.batches_per_epoch) == (
        24,
        4,
        6,
    )
    assert state.total_steps == 10 and state.step == 0
    assert state.streams.seed == 42


def test_build_is_deterministic(kernodeck):
    a, b = build_state(kernodeck), build_state(kernodeck)
    for name in a.model.params:
        assert np.array_equal(a.model.params[name], b.model.params[name])
    assert np.array_equal(a.iterator.permutation, b.iterator.permutation)
    ra = [train_step(a) for _ in range(10)]
    rb = [train_step(b) for _ in range(10)]
    for x, y in zip(ra, rb):
        assert x["train/loss"] == y["train/loss"] and np.array_equal(x["ids"], y["ids"])


def test_five_steps_leave_the_cursor_at_20_of_24(kernodeck):
    state = build_state(kernodeck)
    before = {k: v.copy() for k, v in state.model.params.items()}
    records = [train_step(state) for _ in range(5)]
    assert (state.iterator.cursor, state.iterator.n, state.iterator.epoch) == (20, 24, 0)
    assert (
        [r["step"] for r in records] == [1, 2, 3, 4, 5]
        and state.step == 5
        and state.optimizer.t == 5
    )
    assert all(
        not np.array_equal(before[k], v) for k, v in state.model.params.items()
    )  # params trained
    for r in records:
        assert set(r) >= {"step", "epoch", "train/loss", "lr", "grad_norm", "ids"}
        assert np.isfinite(r["train/loss"]) and np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0


def test_ten_updates_consume_40_rows_and_cross_into_epoch_1(kernodeck):
    state = build_state(kernodeck)
    records = [train_step(state) for _ in range(10)]
    ids = [r["ids"] for r in records]
    assert sum(len(b) for b in ids) == 40
    assert all(b.shape == (4,) for b in ids)
    assert [r["epoch"] for r in records] == [0] * 6 + [1] * 4
    assert (state.iterator.epoch, state.iterator.cursor) == (1, 16)
    assert sorted(np.concatenate(ids[:6]).tolist()) == list(range(24))  # epoch 0: every row once
    assert len(set(np.concatenate(ids[6:]).tolist())) == 16  # epoch 1 so far: no repeats
    lrs = [r["lr"] for r in records]
    assert lrs == pytest.approx(
        [0.03] * 3 + [0.015] * 3 + [0.0075] * 3 + [0.00375], rel=1e-12, abs=0
    )
    assert records[9]["lr"] == pytest.approx(0.00375, rel=1e-12)  # the 10th update
    assert state.optimizer.lr == pytest.approx(0.00375, rel=1e-12)  # and the one after it
    state.total_steps = 11
    assert train_step(state)["lr"] == pytest.approx(0.00375, rel=1e-12)


def test_record_lr_is_the_lr_the_update_used(kernodeck):
    """Update 4's parameter change is Adam's with lr 0.015 (StepLR decayed after update 3)."""
    state = build_state(kernodeck)
    for _ in range(3):
        train_step(state)
    assert state.optimizer.lr == pytest.approx(0.015, rel=1e-12)
    rec = train_step(state)
    assert rec["lr"] == pytest.approx(0.015, rel=1e-12)


def test_the_job_is_plain_values_and_live_objects(kernodeck):
    from omegaconf import DictConfig, ListConfig

    job = build(kernodeck)

    def walk(x, seen):
        if id(x) in seen or isinstance(
            x, (str, bytes, int, float, bool, type(None), np.ndarray, np.generic)
        ):
            return
        seen.add(id(x))
        assert not isinstance(x, (DictConfig, ListConfig)), (
            f"a config node past the door: {type(x)}"
        )
        items = (
            x.items()
            if isinstance(x, dict)
            else (
                enumerate(x)
                if isinstance(x, (list, tuple))
                else vars(x).items()
                if hasattr(x, "__dict__")
                else ()
            )
        )
        for _, v in items:
            walk(v, seen)

    walk(job, set())
    assert job.run_dir.parent.name == "runs" and job.run_dir.name.startswith("kernodeck-")
    assert job.facts["config"] is job.config and job.facts["seed"] == 42


def test_the_parts_are_the_one_list_of_state_machines(kernodeck):
    job = build(kernodeck)
    assert list(job.parts) == list(PARTS)
    live = job.state
    assert [job.parts[p] for p in PARTS] == [
        live.model,
        live.optimizer,
        live.scheduler,
        live.iterator,
        live.progress,
        live.stages,
        live.streams,
    ]
    assert type(live.stages) is StageStates and job.stages is live.stages.stages
    assert (
        {s.name for s in job.stages}
        # stages.resume and stages.train are settings (run/plan.SETTINGS), no stages
        == {k for k, v in kernodeck["stages"].items() if v is not None} - {"resume", "train"}
        != set()
    )


def test_assemble_gives_the_verifier_and_roundtrip_a_runs_parts_and_facts(kernodeck):
    """What a run's manifest says of itself, a run of the same config assembled elsewhere says too."""
    run, alone = build(kernodeck), assemble(kernodeck, identity.identify(kernodeck))
    assert (
        alone.facts == run.facts and alone.sources == run.sources and alone.facts["n_params"] == 33
    )
    assert (
        type(alone.tracker) is Tracker and alone.run_dir is None
    )  # the no-op until build() gives one
    for name, a in run.parts.items():
        assert type(alone.parts[name]) is type(a)
    for k, p in run.state.model.params.items():
        assert np.array_equal(alone.state.model.params[k], p)


def test_the_semantic_hash_is_computed_once_and_names_the_run_directory(kernodeck, monkeypatch):

    calls = []
    real = identity.semantic_config
    monkeypatch.setattr(
        identity, "semantic_config", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    job = build(kernodeck)
    assert len(calls) == 1
    assert (
        job.run_dir.name
        == identity.run_name(kernodeck, job.sources)
        == f"kernodeck-{job.facts['semantic_config_hash'][:12]}"
    )
