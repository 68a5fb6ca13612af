"""Finite-difference gradient checks (float64) and reference comparisons for pipeline.model.layers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.losses import cross_entropy
from pipeline.model import layers as L

EPS = 1e-6  # central-difference step
TOL = 1e-6  # max relative error
FLOOR = 1e-6  # |a| + |b| below this is judged absolutely: gradients that are exactly 0 give only fd noise


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a) + np.abs(b), FLOOR)))


def numeric_grad(f, x: np.ndarray, R: np.ndarray | None = None, eps: float = EPS) -> np.ndarray:
    """Central differences wrt every entry of x (perturbed in place, then restored) of the scalar f(), or,
    given R, of sum(f() * R): the output difference is taken before projecting, so untouched outputs cancel
    exactly and rounding noise stays that of the changed entries, not of the whole sum."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        diff = fp - fm if R is None else np.sum((fp - fm) * R)
        gflat[i] = diff / (2 * eps)
    return g


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
    with pytest.raises(ValueError):
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


def test_gelu_is_gpt2_tanh_approximation_and_grads(rng):
    # Within [-3, 3]: further left 1 + tanh(.) cancels (in torch's formula too) and fd noise swamps the check.
    x = np.clip(rng.standard_normal((3, 7)) * 2, -3, 3)
    out, cache = L.gelu_forward(x)
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(out, ref, rtol=1e-14, atol=1e-15)
    R = projector(x.shape)
    dx = L.gelu_backward(R, cache)
    assert rel_err(dx, numeric_grad(lambda: L.gelu_forward(x)[0], x, R)) < TOL


def test_dropout_fixed_mask_grads(rng):
    x = rng.standard_normal((4, 5))
    R = projector(x.shape)

    def fwd():
        return L.dropout_forward(x, 0.3, np.random.default_rng(7))  # same seed -> same mask every call

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


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_attention_grads(rng, p):
    qkv = rng.standard_normal((2, 5, 3 * 8))
    R = projector((2, 5, 8))

    def fwd():
        return L.attention_forward(qkv, 2, p, np.random.default_rng(11) if p else None)

    out, cache = fwd()
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
    for out, _ in outs:
        assert out.dtype == f32
    assert L.layernorm_backward(x, outs[1][1])[0].dtype == f32
    assert L.gelu_backward(x, outs[2][1]).dtype == f32
    qkv = rng.standard_normal((2, 4, 24)).astype(f32)
    out, cache = L.attention_forward(qkv, 2, 0.1, np.random.default_rng(0))
    assert out.dtype == f32 and L.attention_backward(out, cache).dtype == f32
