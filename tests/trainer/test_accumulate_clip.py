"""trainer.grad_clip, trainer.accumulate and trainer.threads in the step loop: clipping against PyTorch's
formula, N micro-batches against one batch of N*B, a clipped count that resumes, and runs (and resumes
across thread counts) that are byte-identical whatever the threads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import KERNODECK, TINY, config_of, kept, metrics, run_job, the_run

from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.run.assemble import build_dataset, build_state
from pipeline.run.directory import RunDir
from pipeline.run.signals import SIGNALS_STATE
from pipeline.trainer.loop import clip, grad_norm, train_step


def state_of(*overrides: str):
    config = config_of(*overrides)
    dataset = build_dataset(config)
    return build_state(config, dataset.spec, dataset.n_train, dataset)


@pytest.fixture
def states():
    made = []

    def make(*overrides: str):
        made.append(state_of(*overrides))
        return made[-1]

    yield make
    for s in made:
        s.runner.close()


def params_bytes(state) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in state.model.params.items()}


# --- clipping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_clip_is_clip_grad_norm_s_formula(dtype, max_norm):
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(4, 5)).astype(dtype), "b": rng.normal(size=(7,)).astype(dtype)}
    before = {k: v.copy() for k, v in grads.items()}
    norm = grad_norm(grads)
    # the formula, written out: total_norm = ||(||g_1||, ..., ||g_k||)||_2, coef = max_norm / (total_norm + 1e-6)
    total = math.sqrt(sum(np.linalg.norm(g.astype(np.float64)) ** 2 for g in before.values()))
    assert norm == pytest.approx(
        total, rel=1e-6 if dtype == np.float32 else 1e-12
    )  # vdot sums in the dtype
    coef = max_norm / (norm + 1e-6)
    assert clip(grads, norm, max_norm) == (coef < 1)
    for k, g in grads.items():
        assert g.dtype == dtype
        want = before[k] * dtype(coef) if coef < 1 else before[k]
        np.testing.assert_array_equal(g, want)
    if coef < 1:
        assert grad_norm(grads) == pytest.approx(max_norm, rel=1e-5)


def test_clip_agrees_with_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    grads = {"a": rng.normal(size=(6, 3)), "b": rng.normal(size=(3,))}
    tensors = [
        torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads.values()
    ]
    for t, g in zip(tensors, grads.values()):
        t.grad = torch.from_numpy(g.copy())
    total = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm=0.5))
    norm = grad_norm(grads)
    assert clip(grads, norm, 0.5)
    assert norm == pytest.approx(total, rel=1e-12)
    for t, g in zip(tensors, grads.values()):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-14, atol=0)


def test_a_non_finite_norm_is_not_clipped():
    grads = {"a": np.array([np.inf, 1.0])}
    assert not clip(grads, grad_norm(grads), 1.0)
    assert grads["a"][1] == 1.0


def test_a_clipped_update_is_the_clipped_gradient_through_the_optimizer(states):
    """One update by train_step against the same update by hand: pre-clip norm logged, gradient scaled."""
    overrides = (*TINY, "trainer.grad_clip=0.05")
    a, b = states(*overrides), states(*overrides)
    record = train_step(a)
    batch = b.dataset.augment(b.dataset.train_batch(b.iterator.next_ids(), b.dtype), b.streams)
    loss, grads = b.runner.loss_and_grads(b.model, batch, b.streams["dropout"])
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    coef = 0.05 / (norm + 1e-6)
    assert coef < 1  # the point of the test: this update is clipped
    b.optimizer.step({k: g * coef for k, g in grads.items()})
    assert record["grad_norm"] == norm and record["train/loss"] == loss and record["clipped"] == 1
    assert params_bytes(a) == params_bytes(b)


def test_the_clipped_count_is_logged_and_rides_in_the_checkpoint(tmp_path, preempt_at):
    overrides = (*TINY, "trainer.grad_clip=0.65")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_job(*overrides, f"paths.output_dir={ref}")[0] == 0
    lines = RunDir(the_run(ref)).read_metrics()
    expected = np.cumsum([0.65 / (ln["grad_norm"] + 1e-6) < 1 for ln in lines])
    assert [ln["clipped"] for ln in lines] == expected.tolist()
    assert 0 < expected[-1] < len(lines)  # some updates clipped, some not
    preempt_at(5)
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
    assert metrics(the_run(out)) == metrics(the_run(ref))
    assert kept(the_run(out)) == kept(the_run(ref))


def test_no_clipping_logs_no_clipped_count(finished_job):
    assert all(
        "clipped" not in ln for ln in RunDir(the_run(finished_job(*KERNODECK))).read_metrics()
    )


# --- accumulation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, rtol",
    [
        (
            (*KERNODECK, "model.dropout=0.0", "data.input_gain=0", "data.input_noise=0"),
            1e-12,
        ),  # MLP, float64
        ((*TINY, "model.dropout=0.0", "trainer.shards=1"), 2e-5),  # MiniGPT, float32
        ((*TINY, "model.dropout=0.0", "trainer.dtype=float64", "trainer.shards=2"), 1e-12),
    ],
    ids=["mlp", "minigpt-float32", "minigpt-float64-shards"],
)
def test_n_micro_batches_equal_one_batch_of_n_times_b(states, overrides, rtol):
    """Without dropout the mean of N micro-batch gradients is the gradient of their union, to rounding."""
    config = config_of(*overrides)
    B, N = config["trainer"]["batch_size"], 3
    small = states(*overrides, "trainer.accumulate=3")
    big = states(*overrides, f"trainer.batch_size={N * B}")
    for _ in range(4):
        r_small, r_big = train_step(small), train_step(big)
        np.testing.assert_array_equal(r_small["ids"], r_big["ids"])  # the same samples
        assert r_small["train/loss"] == pytest.approx(r_big["train/loss"], rel=rtol)
        assert r_small["grad_norm"] == pytest.approx(r_big["grad_norm"], rel=max(rtol, 1e-12) * 10)
    for k, p in small.model.params.items():
        np.testing.assert_allclose(p, big.model.params[k], rtol=rtol * 10, atol=rtol)


def test_an_update_is_the_mean_of_its_micro_batches_in_order(states):
    """train_step with accumulate=3 against the three micro-batches run by hand: bit for bit."""
    overrides = (*TINY, "trainer.accumulate=3")
    a, b = states(*overrides), states(*overrides)
    record = train_step(a)
    losses, grads = [], []
    for _ in range(3):
        batch = b.dataset.augment(b.dataset.train_batch(b.iterator.next_ids(), b.dtype), b.streams)
        loss, g = b.runner.loss_and_grads(b.model, batch, b.streams["dropout"])
        losses.append(loss)
        grads.append({k: v.copy() for k, v in g.items()})
    mean = {k: (grads[0][k] + grads[1][k] + grads[2][k]) * (1.0 / 3) for k in grads[0]}
    b.optimizer.step(mean)
    assert record["train/loss"] == (losses[0] + losses[1] + losses[2]) / 3
    assert len(record["ids"]) == 3 * a.iterator.batch_size
    assert params_bytes(a) == params_bytes(b)


def test_epochs_count_micro_batches(states):
    """trainer.epochs with accumulation: every micro-batch of every epoch, in updates of N (the rest dropped)."""
    one = states(*KERNODECK, "trainer.max_steps=0", "trainer.epochs=5")
    four = states(*KERNODECK, "trainer.max_steps=0", "trainer.epochs=5", "trainer.accumulate=4")
    assert (
        four.total_steps == one.total_steps // 4
        and one.total_steps == 5 * one.iterator.batches_per_epoch
    )


@pytest.mark.parametrize("k", [2, 5])
def test_accumulation_and_clipping_resume_bit_exactly(tmp_path, preempt_at, finished_job, k):
    overrides = (
        *TINY,
        "trainer.accumulate=3",
        "trainer.grad_clip=0.3",
        "trainer.max_steps=8",
        "checkpoint.every_steps=2",
        "trainer.eval_every=2",
    )
    ref, out = finished_job(*overrides), tmp_path / "out"
    preempt_at(k)
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
    assert kept(the_run(out)) == kept(the_run(ref))
    assert metrics(the_run(out)) == metrics(the_run(ref))


# --- threads -------------------------------------------------------------------------------------


def test_threads_change_no_bit_and_a_run_resumes_on_another_thread_count(tmp_path, preempt_at):
    """MiniGPT in 2 shards with dropout: 1 and 2 threads give the same bytes, and a run preempted on 1 thread
    resumes on 2 (threads are not part of the run's identity) into the same bytes again."""
    one, two, mixed = tmp_path / "one", tmp_path / "two", tmp_path / "mixed"
    assert run_job(*TINY, "trainer.threads=1", f"paths.output_dir={one}")[0] == 0
    assert run_job(*TINY, "trainer.threads=2", f"paths.output_dir={two}")[0] == 0
    assert the_run(one).name == the_run(two).name
    assert kept(the_run(one)) == kept(the_run(two)) and metrics(the_run(one)) == metrics(
        the_run(two)
    )
    preempt_at(5)
    assert run_job(*TINY, "trainer.threads=1", f"paths.output_dir={mixed}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*TINY, "trainer.threads=2", f"paths.output_dir={mixed}")[0] == 0
    assert kept(the_run(mixed)) == kept(the_run(one)) and metrics(the_run(mixed)) == metrics(
        the_run(one)
    )


def test_shards_are_part_of_the_run_s_identity(tmp_path):
    assert run_job(*TINY, "trainer.shards=1", f"paths.output_dir={tmp_path}")[0] == 0
    assert run_job(*TINY, "trainer.shards=2", f"paths.output_dir={tmp_path}")[0] == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_an_evaluation_reads_the_first_eval_batches_the_same_every_time():
    # trainer.eval_batches=N (nanoGPT's eval_iters, Lightning's limit_val_batches): the mean over the first N
    # validation batches, weighted by their sizes, the same subset each time; null reads them all
    from pipeline.trainer.loop import validate

    small = (*TINY, "data.val_batch_size=4")
    full, part = state_of(*small), state_of(*small, "trainer.eval_batches=2")
    batches = list(full.dataset.val_batches(full.dtype))
    assert len(batches) > 2
    losses = [(full.model.evaluate(b), len(b.ids)) for b in batches]

    def mean(pairs):
        return sum(loss * n for loss, n in pairs) / sum(n for _, n in pairs)

    assert validate(part)["val/loss"] == mean(losses[:2]) == validate(part)["val/loss"]
    assert validate(full)["val/loss"] == mean(losses) != mean(losses[:2])
