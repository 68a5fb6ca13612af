"""Finite-difference gradient checks (float64) and reference comparisons for pipeline.model.layers."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
from conftest import central_differences

from pipeline.model import layers as L
from pipeline.model.losses import cross_entropy, cross_entropy_factored

EPS = 1e-6  # central-difference step
TOL = 1e-6  # max relative error
FLOOR = 1e-6  # |a| + |b| below this is judged absolutely: gradients that are exactly 0 give only fd noise


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a) + np.abs(b), FLOOR)))


numeric_grad = functools.partial(central_differences, eps=EPS)


def projector(shape, seed=123):
    # A fixed random projection turns an array output into a scalar whose gradient is O(1) everywhere.
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_linear_grads(rng):
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    R = projector((2, 3, 5))
    out, cache = L.linear_forward(x, w, b)
    assert out.shape == (2, 3, 5)
    np.testing.assert_allclose(out, x @ w + b, rtol=1e-12)
    dx, dw, db = L.linear_backward(R, cache)

    def f():
        return L.linear_forward(x, w, b)[0]

    for got, arr in ((dx, x), (dw, w), (db, b)):
        assert rel_err(got, numeric_grad(f, arr, R)) < TOL


def test_linear_without_bias(rng):
    x, w = rng.standard_normal((6, 4)), rng.standard_normal((4, 3))
    out, cache = L.linear_forward(x, w, None)
    dx, dw, db = L.linear_backward(np.ones_like(out), cache)
    assert db is None and dw.shape == w.shape and dx.shape == x.shape


def test_embedding_grads_with_repeated_tokens(rng):
    V, Tmax, d = 5, 6, 3
    idx = np.array([[0, 1, 1, 4], [4, 4, 2, 0]])  # repeats must accumulate
    wte, wpe = rng.standard_normal((V, d)), rng.standard_normal((Tmax, d))
    R = projector((2, 4, d))
    out, cache = L.embedding_forward(idx, wte, wpe)
    np.testing.assert_array_equal(out, wte[idx] + wpe[:4])
    dwte, dwpe = L.embedding_backward(R, cache)
    assert np.all(dwpe[4:] == 0) and np.all(dwte[3] == 0)  # unused position rows and token 3

    def f():
        return L.embedding_forward(idx, wte, wpe)[0]

    assert rel_err(dwte, numeric_grad(f, wte, R)) < TOL
    assert rel_err(dwpe, numeric_grad(f, wpe, R)) < TOL


def test_embedding_rejects_too_long_sequences(rng):
    with pytest.raises(ValueError, match="sequence length 5 exceeds the 4 learned positions"):
        L.embedding_forward(np.zeros((1, 5), dtype=np.int64), np.zeros((3, 2)), np.zeros((4, 2)))


def test_layernorm_matches_definition_and_grads(rng):
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    out, cache = L.layernorm_forward(x, w, b)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(out, (x - mu) / np.sqrt(var + 1e-5) * w + b, rtol=1e-12, atol=1e-12)
    R = projector(x.shape)
    dx, dw, db = L.layernorm_backward(R, cache)

    def f():
        return L.layernorm_forward(x, w, b)[0]

    for got, arr in ((dx, x), (dw, w), (db, b)):
        assert rel_err(got, numeric_grad(f, arr, R)) < TOL


def test_layernorm_linear_is_the_composition_and_grads(rng):
    # The fused layer folds the norm's affine into the linear: same function as layernorm then linear.
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    g, beta = rng.standard_normal(6), rng.standard_normal(6)
    w, b = rng.standard_normal((6, 5)), rng.standard_normal(5)
    out, cache = L.layernorm_linear_forward(x, g, beta, w, b)
    ref = L.linear_forward(L.layernorm_forward(x, g, beta)[0], w, b)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    R = projector(out.shape)
    grads = L.layernorm_linear_backward(R, cache)
    assert [a.shape for a in grads] == [x.shape, g.shape, beta.shape, w.shape, b.shape]

    def f():
        return L.layernorm_linear_forward(x, g, beta, w, b)[0]

    for got, arr in zip(grads, (x, g, beta, w, b)):
        assert rel_err(got, numeric_grad(f, arr, R)) < TOL


def test_head_grads(rng):
    x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((7, 4))
    out, cache = L.head_forward(x, w)
    np.testing.assert_allclose(out, x.reshape(6, 4) @ w.T, rtol=1e-14)
    R = projector((6, 7))
    dx, dw = L.head_backward(R, cache, np.ones(6))

    def f():
        return L.head_forward(x, w)[0]

    assert rel_err(dx, numeric_grad(f, x, R).reshape(6, 4)) < TOL
    assert rel_err(dw, numeric_grad(f, w, R)) < TOL


def test_head_backward_with_a_row_scale_is_the_scaled_dlogits_backward(rng):
    x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((7, 4))
    _, cache = L.head_forward(x, w)
    d, scale = rng.standard_normal((6, 7)), rng.uniform(0.5, 2.0, 6)
    for got, want in zip(
        L.head_backward(d, cache, scale), L.head_backward(d * scale[:, None], cache, np.ones(6))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_factored_is_cross_entropy(rng, dtype):
    logits, targets = (rng.standard_normal((6, 7)) * 2).astype(dtype), rng.integers(0, 7, 6)
    loss, dlogits = cross_entropy(logits, targets)
    floss, d, scale = cross_entropy_factored(logits.copy(), targets)
    assert floss == loss and d.dtype == scale.dtype == dtype
    np.testing.assert_allclose(
        d * scale[:, None], dlogits, rtol=1e-5 if dtype == np.float32 else 1e-13, atol=1e-7
    )


def test_gelu_is_gpt2_tanh_approximation_and_grads(rng):
    # Within [-3, 3]: further left 1 + tanh(.) cancels (in torch's formula too) and fd noise swamps the check.
    x = np.clip(rng.standard_normal((3, 7)) * 2, -3, 3)
    out, cache = L.gelu_forward(x)
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(out, ref, rtol=1e-14, atol=1e-15)
    R = projector(x.shape)
    dx = L.gelu_backward(R, cache)
    assert rel_err(dx, numeric_grad(lambda: L.gelu_forward(x)[0], x, R)) < TOL


def test_gelu_is_exact_against_extended_precision_and_finite_far_out():
    # The tanh definition evaluated in long double is the oracle down to x = -3 (further left, 1 + tanh
    # cancels even there: 2e-13 off at x = -5); past it, its identity 0.5 (1 + tanh u) = 1 / (1 + exp(-2u))
    # is. Where exp overflows (float32: x < ~-5.5) output and derivative take their limits without warnings.
    c, a = np.longdouble(math.sqrt(2 / math.pi)), np.longdouble(0.044715)
    x = np.linspace(-12, 8, 2001)
    xl = x.astype(np.longdouble)
    u = c * (xl + a * xl**3)
    h = np.where(x >= -3, 0.5 * (1 + np.tanh(u)), 1 / (1 + np.exp(-2 * u)))
    dh = 2 * h * (1 - h) * c * (1 + 3 * a * xl**2)  # d/dx of the sigmoid form
    out, cache = L.gelu_forward(x)
    want = (xl * h).astype(np.float64)
    # Past x = -5 gelu's condition number |x f'/f| grows to ~400 at x = -12: a wider, still tight bound there.
    np.testing.assert_allclose(out[x >= -5], want[x >= -5], rtol=1e-14, atol=0)
    np.testing.assert_allclose(out[x < -5], want[x < -5], rtol=1e-13, atol=0)
    # The derivative is O(1) and crosses 0 near x = -0.75, where only an absolute bound makes sense.
    np.testing.assert_allclose(L.gelu_backward(np.ones_like(x), cache), (h + xl * dh).astype(np.float64), rtol=1e-13,
                               atol=1e-15)  # fmt: skip
    far = np.array([-1e4, -100.0, -20.0, 20.0, 100.0, 1e4], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's default errstate: an overflow would warn
        out, cache = L.gelu_forward(far)
        grad = L.gelu_backward(np.ones_like(far), cache)
    np.testing.assert_array_equal(out, [0, 0, 0, 20, 100, 1e4])
    np.testing.assert_array_equal(grad, [0, 0, 0, 1, 1, 1])
    assert out.dtype == grad.dtype == np.float32


def test_erf_gelu_is_exact_against_extended_precision_and_its_grads(rng):
    # x Phi(x) with Phi from math.erfc (a few ulp, no cancellation far left) in long double: the oracle; its derivative
    # Phi + x phi against finite differences; float32 stays float32 and far out takes its limits silently.
    x = np.linspace(-8, 8, 1601)
    xl = x.astype(np.longdouble)
    phi_cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x], dtype=np.longdouble)
    out, cache = L.gelu_forward(x, erf=True)
    want = (xl * phi_cdf).astype(np.float64)
    # Past x = -5 erfc's condition number (~x^2) widens the bound, as for the tanh form
    np.testing.assert_allclose(out[x >= -5], want[x >= -5], rtol=1e-14, atol=0)
    np.testing.assert_allclose(out[x < -5], want[x < -5], rtol=1e-13, atol=0)
    dens = np.exp(-xl * xl / 2) / np.sqrt(np.longdouble(2 * math.pi))
    np.testing.assert_allclose(L.gelu_backward(np.ones_like(x), cache), (phi_cdf + xl * dens).astype(np.float64),
                               rtol=1e-13, atol=1e-15)  # fmt: skip
    y = rng.standard_normal((3, 7)) * 2
    R = projector(y.shape)
    dy = L.gelu_backward(R, L.gelu_forward(y, erf=True)[1])
    assert rel_err(dy, numeric_grad(lambda: L.gelu_forward(y, erf=True)[0], y, R)) < TOL
    far = np.array([-1e4, -100.0, 100.0, 1e4], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = L.gelu_forward(far, erf=True)
        grad = L.gelu_backward(np.ones_like(far), cache)
    np.testing.assert_array_equal(out, [0, 0, 100, 1e4])
    np.testing.assert_array_equal(grad, [0, 0, 1, 1])
    assert out.dtype == grad.dtype == np.float32


def test_layernorm_and_its_linear_without_bias_are_the_zero_bias_ones(rng):
    # A bias-free model passes None for the norm's beta and the linear's b: the same numbers as zeros, no grads.
    x = rng.standard_normal((2, 3, 6))
    g, w = rng.standard_normal(6), rng.standard_normal((6, 5))
    out, cache = L.layernorm_linear_forward(x, g, None, w, None)
    ref, ref_cache = L.layernorm_linear_forward(x, g, np.zeros(6), w, np.zeros(5))
    np.testing.assert_array_equal(out, ref)
    R = projector(out.shape)
    got, want = L.layernorm_linear_backward(R, cache), L.layernorm_linear_backward(R, ref_cache)
    assert got[2] is None and got[4] is None
    for a, b in zip((got[0], got[1], got[3]), (want[0], want[1], want[3])):
        np.testing.assert_array_equal(a, b)
    out, cache = L.layernorm_forward(x, g, None)
    ref, ref_cache = L.layernorm_forward(x, g, np.zeros(6))
    np.testing.assert_array_equal(out, ref)
    R = projector(x.shape)
    (dx, dg, db), (rx, rg, _) = L.layernorm_backward(R, cache), L.layernorm_backward(R, ref_cache)
    assert db is None
    np.testing.assert_array_equal(dx, rx)
    np.testing.assert_array_equal(dg, rg)


def test_dropout_fixed_mask_grads(rng):
    x = rng.standard_normal((4, 5))
    R = projector(x.shape)

    def fwd():
        return L.dropout_forward(
            x, 0.3, np.random.default_rng(7)
        )  # same seed -> same mask every call

    out, cache = fwd()
    kept = out != 0
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(out[kept], x[kept] / 0.7, rtol=1e-15)  # inverted dropout
    dx = L.dropout_backward(R, cache)
    assert rel_err(dx, numeric_grad(lambda: fwd()[0], x, R)) < TOL


def test_dropout_identity_draws_nothing(rng):
    x = rng.standard_normal((3, 3))
    g = np.random.default_rng(1)
    before = g.bit_generator.state
    for p, r in ((0.0, g), (0.5, None)):
        out, cache = L.dropout_forward(x, p, r)
        assert out is x and cache is None
        assert L.dropout_backward(x, cache) is x
    assert g.bit_generator.state == before


def test_dropout_keeps_expectation_and_dtype():
    x = np.ones((200, 500), dtype=np.float32)
    out, mask = L.dropout_forward(x, 0.25, np.random.default_rng(3))
    assert out.dtype == np.float32 and mask.dtype == np.float32
    assert set(np.unique(out).tolist()) == {0.0, np.float32(1 / 0.75).item()}
    assert abs(out.mean() - 1.0) < 0.01


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_mask_is_the_float32_draw_thresholded_and_rescaled(dtype):
    # The masks (hence training trajectories) are fixed by the draws: u = rng.random(float32), keep u >= p.
    x = np.random.default_rng(0).standard_normal((50, 40)).astype(dtype)
    out, mask = L.dropout_forward(x, 0.3, np.random.default_rng(5))
    keep = np.random.default_rng(5).random(x.shape, dtype=np.float32) >= 0.3
    want = keep.astype(dtype) * dtype(1 / 0.7)
    assert mask.dtype == dtype and mask.tobytes() == want.tobytes()
    assert out.tobytes() == (x * want).tobytes()


def naive_attention(qkv: np.ndarray, n_head: int) -> np.ndarray:
    # Loop reference: per batch, head and query, softmax over keys 0..i.
    B, T, C3 = qkv.shape
    d = C3 // 3
    hs = d // n_head
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    out = np.zeros((B, T, d))
    for b in range(B):
        for h in range(n_head):
            sl = slice(h * hs, (h + 1) * hs)
            for i in range(T):
                s = k[b, : i + 1, sl] @ q[b, i, sl] / math.sqrt(hs)
                p = np.exp(s - s.max())
                out[b, i, sl] = (p / p.sum()) @ v[b, : i + 1, sl]
    return out


def test_attention_matches_naive_reference(rng):
    qkv = rng.standard_normal((3, 6, 3 * 8))
    out, _ = L.attention_forward(qkv, n_head=2)
    np.testing.assert_allclose(out, naive_attention(qkv, 2), rtol=1e-12, atol=1e-13)


def test_attention_is_causal(rng):
    qkv = rng.standard_normal((2, 6, 3 * 8))
    out, _ = L.attention_forward(qkv, n_head=2)
    changed = qkv.copy()
    changed[:, 4] += rng.standard_normal((2, 3 * 8)) * 10
    out2, _ = L.attention_forward(changed, n_head=2)
    np.testing.assert_array_equal(out[:, :4], out2[:, :4])
    assert not np.allclose(out[:, 4:], out2[:, 4:])


@pytest.mark.parametrize("qblock", [64, 2])  # one block; query blocks (0, 2), (2, 5)
def test_attention_in_query_blocks_matches_naive_reference(rng, monkeypatch, qblock):
    monkeypatch.setattr(L, "_QBLOCK", qblock)
    qkv = rng.standard_normal((3, 5, 3 * 8))
    out, _ = L.attention_forward(qkv, n_head=2)
    np.testing.assert_allclose(out, naive_attention(qkv, 2), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_attention_in_query_blocks_is_bitwise_the_full_products(rng, monkeypatch, dtype, p):
    # T=200: blocks (0, 64), (64, 128), (128, 200), the skipped terms exact zeros; the oracle is one block
    qkv, dout = (
        rng.standard_normal((2, 200, 3 * 24)).astype(dtype),
        rng.standard_normal((2, 200, 24)).astype(dtype),
    )
    runs = []
    for qblock in (64, 1 << 20):
        monkeypatch.setattr(L, "_QBLOCK", qblock)
        out, cache = L.attention_forward(qkv, 3, p, np.random.default_rng(5) if p else None)
        runs.append((out, L.attention_backward(dout, cache)))
    for blocked, full in zip(*runs):
        np.testing.assert_array_equal(blocked, full)


@pytest.mark.parametrize("qblock", [64, 2])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_attention_grads(rng, monkeypatch, p, qblock):
    monkeypatch.setattr(L, "_QBLOCK", qblock)
    qkv = rng.standard_normal((2, 5, 3 * 8))
    R = projector((2, 5, 8))

    def fwd():
        return L.attention_forward(qkv, 2, p, np.random.default_rng(11) if p else None)

    _out, cache = fwd()
    dqkv = L.attention_backward(R, cache)
    assert dqkv.shape == qkv.shape
    assert rel_err(dqkv, numeric_grad(lambda: fwd()[0], qkv, R)) < TOL


def test_cross_entropy_grads(rng):
    logits = rng.standard_normal((6, 7)) * 2
    targets = rng.integers(0, 7, 6)
    loss, dlogits = cross_entropy(logits, targets)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert abs(loss - (-logp[np.arange(6), targets].mean())) < 1e-12
    assert rel_err(dlogits, numeric_grad(lambda: cross_entropy(logits, targets)[0], logits)) < TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_overwrite_gives_the_same_numbers_in_the_logits_memory(rng, dtype):
    logits = (rng.standard_normal((6, 7)) * 2).astype(dtype)
    targets = rng.integers(0, 7, 6)
    kept = logits.copy()
    loss, dlogits = cross_entropy(logits, targets)
    np.testing.assert_array_equal(logits, kept)  # untouched by default
    loss2, dlogits2 = cross_entropy(logits, targets, overwrite=True)
    assert loss2 == loss and dlogits2 is logits and dlogits.dtype == dtype
    np.testing.assert_array_equal(dlogits2, dlogits)


def test_float32_stays_float32(rng):
    f32 = np.float32
    x = rng.standard_normal((2, 4, 8)).astype(f32)
    w, b = np.ones(8, f32), np.zeros(8, f32)
    outs = [
        L.linear_forward(x, rng.standard_normal((8, 24)).astype(f32), np.zeros(24, f32)),
        L.layernorm_forward(x, w, b),
        L.gelu_forward(x),
        L.dropout_forward(x, 0.5, np.random.default_rng(0)),
    ]
    w2, b2 = rng.standard_normal((8, 24)).astype(f32), np.zeros(24, f32)
    outs.append(L.layernorm_linear_forward(x, w, b, w2, b2))
    outs.append(L.head_forward(x, rng.standard_normal((5, 8)).astype(f32)))
    for out, _ in outs:
        assert out.dtype == f32
    assert L.layernorm_backward(x, outs[1][1])[0].dtype == f32
    assert L.gelu_backward(x, outs[2][1]).dtype == f32
    assert all(a.dtype == f32 for a in L.layernorm_linear_backward(outs[4][0], outs[4][1]))
    assert all(a.dtype == f32 for a in L.head_backward(outs[5][0], outs[5][1], np.ones(8, f32)))
    assert all(
        a.dtype == f32 for a in cross_entropy(outs[5][0], np.arange(8) % 5, overwrite=True)[1:]
    )
    qkv = rng.standard_normal((2, 4, 24)).astype(f32)
    out, cache = L.attention_forward(qkv, 2, 0.1, np.random.default_rng(0))
    assert out.dtype == f32 and L.attention_backward(out, cache).dtype == f32
