"""Shards: byte-identical results for any thread count, one big batch to rounding, the documented RNG split."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from pipeline.data.base import Batch, DataSpec
from pipeline.model.minigpt import MiniGPT
from pipeline.model.mlp import MLP
from pipeline.trainer.parallel import Shards, child_rngs, split

THREADS = (1, 2, 4)


def minigpt(dropout=0.0, dtype="float32") -> MiniGPT:
    return MiniGPT(DataSpec(vocab_size=23), n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=dropout,
                   attn_dropout=dropout, init_std=0.02, bias=True, gelu="tanh", dtype=dtype,
                   rng=np.random.default_rng(0))  # fmt: skip


def tokens(B, T=8, vocab=23, seed=1) -> Batch:
    r = np.random.default_rng(seed)
    return Batch(ids=np.arange(B), x=r.integers(0, vocab, (B, T)), y=r.integers(0, vocab, (B, T)))


def mlp(dropout=0.0) -> MLP:
    return MLP(
        DataSpec(n_features=3, n_targets=2),
        hidden=[8, 8],
        activation="tanh",
        dropout=dropout,
        dtype="float64",
        rng=np.random.default_rng(0),
    )


def rows(B, seed=1) -> Batch:
    r = np.random.default_rng(seed)
    return Batch(ids=np.arange(B), x=r.standard_normal((B, 3)), y=r.standard_normal((B, 2)))


def run(model, batch, shards, threads, seed=7):
    rng = np.random.default_rng(seed)
    with Shards(shards, threads) as s:
        loss, grads = s.loss_and_grads(model, batch, rng)
    return loss, grads, rng.bit_generator.state


def assert_same_bytes(a, b):
    (la, ga, sa), (lb, gb, sb) = a, b
    assert np.float64(la).tobytes() == np.float64(lb).tobytes()
    assert list(ga) == list(gb)
    for name in ga:
        assert ga[name].dtype == gb[name].dtype and ga[name].shape == gb[name].shape, name
        assert ga[name].tobytes() == gb[name].tobytes(), name
    assert sa == sb  # the dropout stream is left in the same state


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("make, batch", [(lambda: minigpt(0.2), tokens(12)), (lambda: mlp(0.25), rows(12))],
                         ids=["minigpt", "mlp"])  # fmt: skip
def test_thread_count_does_not_change_a_bit(make, batch, shards):
    model = make()
    ref = run(model, batch, shards, 1)
    for threads in THREADS[1:]:
        assert_same_bytes(run(model, batch, shards, threads), ref)
    assert not np.array_equal(
        ref[1][next(iter(ref[1]))], run(model, batch, shards, 1, seed=8)[1][next(iter(ref[1]))]
    )


def kernodeck():
    # experiment=kernodeck's model and batch: a 2->8->1 MLP, float64, dropout 0.25, batch 4
    model = MLP(
        DataSpec(n_features=2, n_targets=1),
        hidden=[8],
        activation="tanh",
        dropout=0.25,
        dtype="float64",
        rng=np.random.default_rng(42),
    )
    r = np.random.default_rng(3)
    return model, Batch(ids=np.arange(4), x=r.standard_normal((4, 2)), y=r.standard_normal((4, 1)))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(
    "make", [lambda: (minigpt(0.2), tokens(6)), kernodeck], ids=["minigpt", "kernodeck"]
)
def test_one_shard_is_the_model_call_itself(make, threads):
    # The caller's BLAS setting (here the default, all cores) is what the model call sees outside Shards.
    model, batch = make()
    rng = np.random.default_rng(7)
    want = model.loss_and_grads(batch, rng)
    assert_same_bytes(run(model, batch, 1, threads), (*want, rng.bit_generator.state))


@pytest.mark.parametrize("B, shards", [(12, 2), (12, 4), (12, 3), (7, 2), (5, 3), (3, 4)])
@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-12), ("float32", 2e-5)])
def test_shards_equal_one_batch_to_rounding(B, shards, dtype, rtol):
    # Without dropout a shard split only changes the summation order (uneven and empty pieces included).
    model, batch = minigpt(0.0, dtype), tokens(B)
    loss, grads = model.loss_and_grads(batch, None)
    with Shards(shards, 2) as s:
        sloss, sgrads = s.loss_and_grads(model, batch, None)
    assert abs(sloss - loss) <= rtol * abs(loss)
    for name, g in grads.items():
        assert sgrads[name].dtype == np.dtype(dtype), name
        np.testing.assert_allclose(
            sgrads[name], g, rtol=rtol, atol=rtol * np.abs(g).max(), err_msg=name
        )


def test_mlp_shards_equal_one_batch_to_rounding():
    model, batch = mlp(), rows(10)
    loss, grads = model.loss_and_grads(batch, None)
    with Shards(3, 2) as s:
        sloss, sgrads = s.loss_and_grads(model, batch, None)
    assert abs(sloss - loss) <= 1e-14 * abs(loss)
    for name, g in grads.items():
        np.testing.assert_allclose(sgrads[name], g, rtol=1e-13, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("B", [11, 12])
def test_pieces_child_streams_and_sums_are_as_documented(B):
    # Oracle: piece k is rows [a_k, b_k) as np.array_split cuts them, run with Generator(PCG64(seeds[k])),
    # seeds being `shards` uint64 drawn from the dropout stream in one call; the loss is sum_k (B_k / B) l_k;
    # the grads (g_0 + g_1 + g_2) * (1/3) for equal pieces (B = 12), else sum_k g_k * (B_k / B) (B = 11).
    model, batch, shards = mlp(0.25), rows(B), 3
    pieces = split(batch, shards)
    for piece, ids in zip(pieces, np.array_split(batch.ids, shards)):
        np.testing.assert_array_equal(piece.ids, ids)
        np.testing.assert_array_equal(piece.x, batch.x[ids])
    rng = np.random.default_rng(7)
    seeds = rng.integers(0, 2**64, size=shards, dtype=np.uint64)
    outs = [
        model.loss_and_grads(p, np.random.Generator(np.random.PCG64(int(s))))
        for p, s in zip(pieces, seeds)
    ]
    weights = [len(p.ids) / B for p in pieces]
    loss = 0.0
    for w, (l_k, _) in zip(weights, outs):
        loss += w * l_k
    if B % shards == 0:
        grads = {
            name: (outs[0][1][name] + outs[1][1][name] + outs[2][1][name]) * (1 / 3)
            for name in model.params
        }
    else:
        grads = {name: sum((g[name] * w for w, (_, g) in zip(weights[1:], outs[1:])), outs[0][1][name] * weights[0])
                 for name in model.params}  # fmt: skip
    assert_same_bytes(run(model, batch, shards, 2), (loss, grads, rng.bit_generator.state))
    assert child_rngs(None, 3) == [None, None, None]


def test_results_are_fresh_arrays_the_next_call_leaves_alone():
    model, batch = minigpt(0.2), tokens(8)
    with Shards(2, 2) as s:
        _, g1 = s.loss_and_grads(model, batch, np.random.default_rng(1))
        kept = {k: v.copy() for k, v in g1.items()}
        s.loss_and_grads(model, batch, np.random.default_rng(2))
    for name, g in g1.items():
        np.testing.assert_array_equal(g, kept[name])
        assert g.flags.writeable and g.flags.c_contiguous
    assert len({id(g) for g in g1.values()}) == len(g1)


def blas_threads() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_blas_is_single_threaded_while_open_and_restored_by_close():
    seen = []

    class Spy:
        def loss_and_grads(self, batch, rng):
            seen.append(set(blas_threads()))
            return 1.0, {"w": np.ones(2) * len(batch.ids)}

        def evaluate(self, batch):
            seen.append(set(blas_threads()))
            return 1.0

    before = blas_threads()
    with Shards(2, 2) as s:
        assert set(blas_threads()) == {1}
        loss, grads = s.loss_and_grads(Spy(), rows(4), None)
        threadpool_limits(
            2, "blas"
        )  # someone else's setting between calls is undone at the next call
        s.mean_loss(Spy(), [rows(4), rows(3)])
    assert loss == 1.0 and np.array_equal(grads["w"], [2.0, 2.0])  # (2 + 2) / 2
    assert len(seen) == 4 and all(t == {1} for t in seen)
    assert blas_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        s.loss_and_grads(Spy(), rows(4), None)
    s.close()  # idempotent


@pytest.mark.parametrize("threads", THREADS)
def test_mean_loss_is_the_batch_size_weighted_mean_in_batch_order(threads):
    model = minigpt(0.2)
    batches = [tokens(B, seed=s) for s, B in enumerate((4, 3, 4, 1, 2))]
    total, count = 0.0, 0
    for b in batches:  # the loop the trainer had: its exact summation order
        total += model.evaluate(b) * len(b.ids)
        count += len(b.ids)
    with Shards(2, threads) as s:
        assert s.mean_loss(model, iter(batches)) == total / count
        assert (
            s.mean_loss(model, [tokens(0), *batches, tokens(0)]) == total / count
        )  # empty batches skipped
        with pytest.raises(ValueError, match="no samples"):
            s.mean_loss(model, [])


class Boom(Exception):
    pass


def test_a_failing_shard_raises_and_the_pool_still_works():
    class Fails:
        def loss_and_grads(self, batch, rng):
            if batch.ids[0] == 2:
                raise Boom("shard 1")
            return 0.5, {"w": np.zeros(1)}

    with Shards(4, 2) as s:
        with pytest.raises(Boom):
            s.loss_and_grads(Fails(), rows(8), None)
        loss, _ = s.loss_and_grads(mlp(), rows(8), None)
        assert np.isfinite(loss)


def test_default_threads_are_the_available_cores():
    import os

    with Shards(2) as s:
        assert s.threads == len(os.sched_getaffinity(0))
