"""Finite-difference gradient checks for every layer of the MLP and for both losses (float64, central
differences, max relative error < 1e-6)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import central_differences

from pipeline.data.base import Batch, DataSpec
from pipeline.model.losses import cross_entropy, mse
from pipeline.model.mlp import ACTIVATIONS, MLP

H = 1e-6  # central-difference step
TOL = 1e-6  # max relative error
FLOOR = 1e-8  # |a| + |n| below this counts as "both zero" (dead relu units give exactly 0 on both sides)


def rel_error(analytic: np.ndarray, numeric: np.ndarray) -> float:
    analytic, numeric = np.asarray(analytic, np.float64), np.asarray(numeric, np.float64)
    assert analytic.shape == numeric.shape
    return float(
        np.max(np.abs(analytic - numeric) / np.maximum(np.abs(analytic) + np.abs(numeric), FLOOR))
    )


numeric_grad = functools.partial(central_differences, eps=H)


def make_mlp(hidden, activation, dropout=0.0, n_features=3, n_targets=2, seed=0) -> MLP:
    spec = DataSpec(n_features=n_features, n_targets=n_targets)
    return MLP(
        spec,
        hidden=hidden,
        activation=activation,
        dropout=dropout,
        dtype="float64",
        rng=np.random.default_rng(seed),
    )


def data(seed=1, batch=5, n_features=3, n_targets=2):
    g = np.random.default_rng(seed)
    return g.normal(size=(batch, n_features)), g.normal(size=(batch, n_targets))


def pre_activations(model: MLP, x: np.ndarray) -> list[np.ndarray]:
    """Every hidden layer's pre-activation, without dropout (for the relu kink guard)."""
    out, h = [], x
    for i in range(model.n_layers - 1):
        z = h @ model.params[f"layers.{i}.weight"] + model.params[f"layers.{i}.bias"]
        out.append(z)
        h = np.tanh(z) if model.activation is np.tanh else np.maximum(z, 0)
    return out


# --- the activations' own derivatives (from the activation's output)


@pytest.mark.parametrize("name", ["tanh", "relu"])
def test_activation_backward_matches_finite_differences(name):
    act, derivative = ACTIVATIONS[name]
    g = np.random.default_rng(2)
    z = g.normal(size=(4, 6))
    z[np.abs(z) < 1e-3] = 0.5  # keep relu away from its kink
    r = g.normal(size=z.shape)  # a random probe: f(z) = sum(act(z) * r), df/dz = r * act'(z)
    num = numeric_grad(lambda: float(np.sum(act(z) * r)), z)
    assert rel_error(r * derivative(act(z)), num) < TOL


def test_activation_values():
    z = np.array([[-2.0, -0.5, 0.0, 0.5, 2.0]])
    np.testing.assert_array_equal(ACTIVATIONS["relu"][0](z), np.maximum(z, 0))
    np.testing.assert_allclose(ACTIVATIONS["tanh"][0](z), np.tanh(z), rtol=0, atol=0)


# --- the network's backward (a random probe on the output isolates it from the loss)

CASES = [
    pytest.param([], "tanh", 0.0, id="linear"),  # a single linear layer, no activation
    pytest.param([5, 4], "tanh", 0.0, id="tanh"),
    pytest.param([5, 4], "relu", 0.0, id="relu"),
    pytest.param([5, 4], "tanh", 0.3, id="tanh+dropout"),
    pytest.param([5, 4], "relu", 0.3, id="relu+dropout"),
]


@pytest.mark.parametrize("hidden,activation,dropout", CASES)
def test_backward_matches_finite_differences_for_every_parameter(hidden, activation, dropout):
    model = make_mlp(hidden, activation, dropout)
    x, _ = data()
    r = np.random.default_rng(5).normal(size=(x.shape[0], 2))
    if activation == "relu":
        # guard: a perturbation of H must not cross a kink, or the finite difference is meaningless
        assert min(np.abs(z).min() for z in pre_activations(model, x)) > 1e-4
    # Dropout: every evaluation re-seeds a generator to the same state, so the mask is identical.
    state = np.random.Generator(np.random.PCG64(123)).bit_generator.state

    def rng():
        if dropout == 0.0:
            return None
        g = np.random.Generator(np.random.PCG64())
        g.bit_generator.state = state
        return g

    def f():
        return float(np.sum(model.forward(x, rng())[0] * r))

    _out, caches = model.forward(x, rng())
    if dropout:
        masks = [c["mask"] for c in caches if "mask" in c]
        assert len(masks) == len(hidden)  # dropout after every hidden layer
        assert any((m == 0).any() for m in masks)  # the check covers dropped units
    grads = model.backward(r, caches)
    assert set(grads) == set(model.params)
    for name, p in model.params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == np.float64
        err = rel_error(grads[name], numeric_grad(f, p))
        assert err < TOL, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("hidden,activation,dropout", CASES)
def test_loss_and_grads_matches_finite_differences(hidden, activation, dropout):
    """The full training path: forward (with dropout), MSE, backward."""
    model = make_mlp(hidden, activation, dropout)
    x, y = data()
    batch = Batch(ids=np.arange(len(x)), x=x, y=y)
    seed_state = np.random.Generator(np.random.PCG64(7)).bit_generator.state

    def rng():
        g = np.random.Generator(np.random.PCG64())
        g.bit_generator.state = seed_state
        return g

    loss, grads = model.loss_and_grads(batch, rng())
    assert loss == pytest.approx(model.loss_and_grads(batch, rng())[0], rel=0, abs=0)
    for name, p in model.params.items():
        err = rel_error(grads[name], numeric_grad(lambda: model.loss_and_grads(batch, rng())[0], p))
        assert err < TOL, f"{name}: relative error {err:.3g}"


def test_dropout_forward_is_inverted_dropout_from_the_given_generator():
    """Oracle: h = tanh(x W + b) * (u >= p) / (1 - p) with u the generator's next uniforms."""
    p = 0.25
    model = make_mlp([6], "tanh", p)
    x, _ = data(batch=8)
    out, _ = model.forward(x, np.random.default_rng(11))
    u = np.random.default_rng(11).random((8, 6))
    w0, b0 = model.params["layers.0.weight"], model.params["layers.0.bias"]
    w1, b1 = model.params["layers.1.weight"], model.params["layers.1.bias"]
    h = np.tanh(x @ w0 + b0) * (u >= p) / (1 - p)
    np.testing.assert_allclose(out, h @ w1 + b1, rtol=1e-13, atol=1e-15)
    # eval mode: no dropout and no draws
    g = np.random.default_rng(0)
    before = g.bit_generator.state
    np.testing.assert_allclose(
        model.predict(x), np.tanh(x @ w0 + b0) @ w1 + b1, rtol=1e-13, atol=1e-15
    )
    batch = Batch(ids=np.arange(8), x=x, y=np.zeros((8, 2)))
    assert model.evaluate(batch) == pytest.approx(
        np.mean((np.tanh(x @ w0 + b0) @ w1 + b1) ** 2), rel=1e-13
    )
    assert g.bit_generator.state == before


def test_mlp_shapes_and_parameter_names():
    model = make_mlp([5, 4], "tanh")
    assert {k: v.shape for k, v in model.params.items()} == {
        "layers.0.weight": (3, 5),
        "layers.0.bias": (5,),
        "layers.1.weight": (5, 4),
        "layers.1.bias": (4,),
        "layers.2.weight": (4, 2),
        "layers.2.bias": (2,),
    }


# --- the losses


def test_mse_value_and_gradient():
    g = np.random.default_rng(3)
    pred, target = g.normal(size=(6, 3)), g.normal(size=(6, 3))
    loss, dpred = mse(pred, target)
    assert loss == pytest.approx(float(np.mean((pred - target) ** 2)), rel=1e-14)
    num = numeric_grad(lambda: mse(pred, target)[0], pred)
    assert rel_error(dpred, num) < TOL


def _ce_oracle(logits: np.ndarray, targets: np.ndarray) -> float:
    # Naive log-softmax in float64 (fine for moderate logits).
    logp = logits - np.log(np.sum(np.exp(logits), axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(targets)), targets]))


def test_cross_entropy_value_and_gradient():
    g = np.random.default_rng(4)
    logits, targets = g.normal(size=(7, 5)), g.integers(0, 5, size=7)
    loss, dlogits = cross_entropy(logits, targets)
    assert loss == pytest.approx(_ce_oracle(logits, targets), rel=1e-13)
    num = numeric_grad(lambda: cross_entropy(logits, targets)[0], logits)
    assert rel_error(dlogits, num) < TOL


def test_cross_entropy_is_stable_for_large_logits():
    g = np.random.default_rng(5)
    logits, targets = g.normal(size=(4, 6)), g.integers(0, 6, size=4)
    loss, grad = cross_entropy(logits, targets)
    big_loss, big_grad = cross_entropy(logits + 1000.0, targets)  # softmax is shift invariant
    assert np.isfinite(big_loss) and big_loss == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(big_grad, grad, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [60.0, -60.0, -70.0, 300.0])
def test_cross_entropy_is_shift_invariant_across_the_unshifted_range(dtype, offset):
    # Logits within +-64 skip the row-max shift, others take it: both paths give the small logits' values.
    g = np.random.default_rng(6)
    logits, targets = g.normal(size=(5, 9)) * 3, g.integers(0, 9, size=5)
    loss, grad = cross_entropy(logits.astype(dtype), targets)
    moved_loss, moved_grad = cross_entropy((logits + offset).astype(dtype), targets)
    assert np.isfinite(moved_loss) and moved_grad.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert moved_loss == pytest.approx(loss, rel=tol, abs=tol * 64)
    np.testing.assert_allclose(moved_grad, grad, rtol=tol * 64, atol=tol)
