"""SGD, Adam and AdamW against a hand derivation of PyTorch's update formulas (plain Python floats),
and the optimizer state round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.optimizer.adam import Adam, AdamW
from pipeline.optimizer.sgd import SGD
from pipeline.stateful import StateMismatch, copy_tree, restore

P0 = [0.8, -1.3]  # a 2-element parameter
GRADS = [[0.5, -0.25], [-0.3, 0.7], [0.9, 0.1]]  # fixed gradients for steps 1, 2, 3
LRS = [
    0.1,
    0.05,
    0.02,
]  # the lr a scheduler set before each step (torch reads param_groups' lr per step)
REL = 1e-12
# torch.optim's own defaults, which the hand derivations take too (the classes have none: the YAML holds them)
SGD_DEFAULTS = dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
ADAM_DEFAULTS = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, weight_decay_on="all")
DEFAULTS = {SGD: SGD_DEFAULTS, Adam: ADAM_DEFAULTS, AdamW: ADAM_DEFAULTS}


def sgd(params, **kw) -> SGD:
    return SGD(params, **{**SGD_DEFAULTS, **kw})


def adam(params, **kw) -> Adam:
    return Adam(params, **{**ADAM_DEFAULTS, **kw})


# --- the hand derivations: plain floats, one element at a time, written from torch's documented algorithms


def sgd_by_hand(p0, grads, lrs, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    out, p, buf = [], list(p0), [None] * len(p0)
    for t, (g_t, lr) in enumerate(zip(grads, lrs), start=1):
        for i in range(len(p)):
            g = g_t[i] + weight_decay * p[i]
            if momentum != 0:
                if t == 1:
                    buf[i] = g  # buffer = the first (decayed) gradient, undamped
                else:
                    buf[i] = momentum * buf[i] + (1 - dampening) * g
                g = g + momentum * buf[i] if nesterov else buf[i]
            p[i] = p[i] - lr * g
        out.append(list(p))
    return out


def adam_by_hand(
    p0, grads, lrs, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False
):
    out, p = [], list(p0)
    m, v = [0.0] * len(p0), [0.0] * len(p0)
    for t, (g_t, lr) in enumerate(zip(grads, lrs), start=1):
        for i in range(len(p)):
            g = g_t[i]
            if decoupled:
                p[i] = p[i] * (
                    1 - lr * weight_decay
                )  # AdamW: decay the weight itself, before the update
            else:
                g = g + weight_decay * p[i]  # Adam: L2 penalty folded into the gradient
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t)
            v_hat = v[i] / (1 - beta2**t)
            p[i] = p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
        out.append(list(p))
    return out


def run(opt_cls, lrs=LRS, **kw):
    p = np.array(P0, dtype=np.float64)
    opt = opt_cls({"w": p}, lr=lrs[0], **{**DEFAULTS[opt_cls], **kw})
    out = []
    for g, lr in zip(GRADS, lrs):
        opt.lr = lr
        opt.step({"w": np.array(g, dtype=np.float64)})
        assert opt.params["w"] is p  # updated in place
        assert p.dtype == np.float64
        out.append(p.tolist())
    assert opt.t == len(GRADS)
    return out


def assert_trajectory(got, expected):
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        for i, (a, b) in enumerate(zip(g, e)):
            assert math.isclose(a, b, rel_tol=REL, abs_tol=0.0), (
                f"step {step} element {i}: {a!r} != {b!r}"
            )


SGD_CASES = [
    pytest.param(dict(momentum=0.0), id="plain"),
    pytest.param(dict(momentum=0.9), id="momentum"),
    pytest.param(dict(momentum=0.9, nesterov=True), id="nesterov"),
    pytest.param(dict(momentum=0.9, weight_decay=0.1), id="momentum+wd"),
    pytest.param(dict(momentum=0.9, nesterov=True, weight_decay=0.1), id="nesterov+wd"),
    pytest.param(dict(momentum=0.9, dampening=0.5, weight_decay=0.1), id="momentum+dampening+wd"),
]


@pytest.mark.parametrize("kw", SGD_CASES)
@pytest.mark.parametrize("lrs", [[0.1] * 3, LRS], ids=["fixed-lr", "scheduled-lr"])
def test_sgd_matches_hand_derivation(kw, lrs):
    assert_trajectory(run(SGD, lrs, **kw), sgd_by_hand(P0, GRADS, lrs, **kw))


def test_sgd_hand_derivation_spot_values():
    # The derivation itself, pinned for momentum 0.9, lr 0.1 at step 2: buf = 0.9 * 0.5 + (-0.3) = 0.15.
    assert sgd_by_hand(P0, GRADS, [0.1] * 3, momentum=0.9)[1][0] == pytest.approx(
        0.8 - 0.1 * 0.5 - 0.1 * 0.15
    )
    # nesterov at step 1: g + mu * buf = 0.5 + 0.9 * 0.5
    assert sgd_by_hand(P0, GRADS, [0.1] * 3, momentum=0.9, nesterov=True)[0][0] == pytest.approx(
        0.8 - 0.1 * 0.95
    )


def test_sgd_nesterov_needs_momentum_and_no_dampening():
    with pytest.raises(
        ValueError, match="nesterov momentum requires momentum > 0 and dampening = 0"
    ):
        sgd({"w": np.zeros(2)}, lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(
        ValueError, match="nesterov momentum requires momentum > 0 and dampening = 0"
    ):
        sgd({"w": np.zeros(2)}, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)


ADAM_CASES = [
    pytest.param(Adam, dict(), dict(), id="adam"),
    pytest.param(Adam, dict(weight_decay=0.1), dict(weight_decay=0.1), id="adam+l2"),
    pytest.param(
        Adam,
        dict(betas=(0.8, 0.99), eps=1e-3),
        dict(beta1=0.8, beta2=0.99, eps=1e-3),
        id="adam-betas-eps",
    ),
    pytest.param(AdamW, dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled=True), id="adamw"),
]


@pytest.mark.parametrize("cls,kw,hand_kw", ADAM_CASES)
@pytest.mark.parametrize("lrs", [[0.1] * 3, LRS], ids=["fixed-lr", "scheduled-lr"])
def test_adam_matches_hand_derivation(cls, kw, hand_kw, lrs):
    assert_trajectory(run(cls, lrs, **kw), adam_by_hand(P0, GRADS, lrs, **hand_kw))


def test_adam_first_step_is_lr_times_sign():
    # With bias correction, step 1 moves each weight by lr * g / (|g| + eps) ~ lr * sign(g).
    got = run(Adam, [0.1] * 3)[0]
    assert got == pytest.approx([0.8 - 0.1, -1.3 + 0.1], rel=1e-7)


def test_adam_and_adamw_differ_with_weight_decay():
    assert run(Adam, weight_decay=0.1)[-1] != pytest.approx(
        run(AdamW, weight_decay=0.1)[-1], rel=1e-9
    )


def test_weight_decay_on_matrices_decays_2d_weights_only():
    # AdamW's hand derivation per parameter: the matrix decays (weight_decay 0.1), the vector is plain Adam
    w, b = np.array([[0.8, -1.3]]), np.array([0.8, -1.3])
    opt = AdamW(
        {"w": w, "b": b},
        lr=LRS[0],
        **{**ADAM_DEFAULTS, "weight_decay": 0.1, "weight_decay_on": "matrices"},
    )
    for g, lr in zip(GRADS, LRS):
        opt.lr = lr
        opt.step({"w": np.array([g]), "b": np.array(g)})
    assert_trajectory(
        [w[0].tolist()], adam_by_hand(P0, GRADS, LRS, weight_decay=0.1, decoupled=True)[-1:]
    )
    assert_trajectory([b.tolist()], adam_by_hand(P0, GRADS, LRS)[-1:])


def test_step_rejects_gradients_that_do_not_match_parameters():
    opt = adam({"w": np.zeros(2)}, lr=0.1)
    with pytest.raises(KeyError, match=r"gradients do not match parameters: \['v', 'w'\]"):
        opt.step({"v": np.zeros(2)})
    assert opt.t == 0


# --- state round trip


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"layers.0.weight": g.normal(size=(3, 4)), "layers.0.bias": g.normal(size=(4,))}


def _grads(k: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(100 + k)
    return {"layers.0.weight": g.normal(size=(3, 4)), "layers.0.bias": g.normal(size=(4,))}


ROUND_TRIP = [
    pytest.param(
        SGD, {**SGD_DEFAULTS, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, id="sgd-momentum"
    ),
    pytest.param(
        SGD, {**SGD_DEFAULTS, "lr": 0.1, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"
    ),
    pytest.param(SGD, {**SGD_DEFAULTS, "lr": 0.1}, id="sgd-plain"),
    pytest.param(Adam, {**ADAM_DEFAULTS, "lr": 0.01, "weight_decay": 0.01}, id="adam"),
    pytest.param(AdamW, {**ADAM_DEFAULTS, "lr": 0.01, "weight_decay": 0.1}, id="adamw"),
]


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("cls,kw", ROUND_TRIP)
def test_state_round_trip_continues_bit_identically(cls, kw, k):
    params = _params()
    original = cls(params, **kw)
    for i in range(k):
        original.lr = kw["lr"] * 0.5**i  # a schedule moved the lr
        original.step(_grads(i))
    state = copy_tree(original.state_dict())  # as a checkpoint holds it
    assert set(state) == {"t", *original.buffers} and all(
        set(state[b]) == set(params) for b in original.buffers
    )

    fresh_params = {n: p.copy() for n, p in params.items()}  # as restored from the model checkpoint
    fresh = cls(
        fresh_params, **{**kw, "lr": original.lr}
    )  # the lr is the scheduler's to set, not state
    restore({"optimizer": fresh}, {"optimizer": state}, only=("optimizer",))
    assert fresh.t == original.t == k
    for b in fresh.buffers:
        for n in params:
            assert fresh.state[f"{b}.{n}"] is not state[b][n]  # loaded by copy, not aliased
    for i in range(k, k + 4):
        for opt in (original, fresh):
            opt.step(_grads(i))
        for n in params:
            assert np.array_equal(params[n], fresh_params[n]), f"{n} diverged at step {i + 1}"
        for key in original.state:
            assert np.array_equal(original.state[key], fresh.state[key])


def test_state_dict_before_first_step_has_every_buffer():
    opt = adam(_params(), lr=0.01)
    state = opt.state_dict()
    assert state["t"] == 0 and "lr" not in state  # the scheduler sets the lr from the config
    assert {b: sorted(state[b]) for b in ("exp_avg", "exp_avg_sq")} == {
        b: sorted(_params()) for b in ("exp_avg", "exp_avg_sq")
    }


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda s: s["exp_avg"].pop("layers.0.bias"), id="missing-key"),
        pytest.param(
            lambda s: s["exp_avg"].__setitem__("layers.1.bias", np.zeros(4)), id="extra-key"
        ),
        pytest.param(
            lambda s: s["exp_avg_sq"].__setitem__("layers.0.weight", np.zeros((4, 3))),
            id="wrong-shape",
        ),
        pytest.param(
            lambda s: s["exp_avg"].__setitem__("layers.0.bias", np.zeros(5)), id="wrong-length"
        ),
        pytest.param(
            lambda s: s["exp_avg"].__setitem__("layers.0.bias", np.zeros(4, np.float32)),
            id="wrong-dtype",
        ),
        pytest.param(lambda s: s.__setitem__("t", -1), id="negative-t"),
        pytest.param(lambda s: s.__setitem__("t", "3"), id="t-not-a-number"),
    ],
)
def test_a_mismatched_state_is_refused_and_the_optimizer_left_untouched(mutate):
    original = adam(_params(), lr=0.01)
    original.step(_grads(0))
    state = copy_tree(original.state_dict())
    mutate(state)
    fresh = adam(_params(), lr=0.01)
    before = copy_tree(fresh.state_dict())
    with pytest.raises(StateMismatch, match="optimizer"):
        restore({"optimizer": fresh}, {"optimizer": state}, only=("optimizer",))
    after = fresh.state_dict()
    assert after["t"] == before["t"] and all(
        np.array_equal(after[b][n], before[b][n]) for b in fresh.buffers for n in before[b]
    )


def test_another_optimizers_state_is_refused():
    a = adam(_params(), lr=0.01)
    a.step(_grads(0))
    with pytest.raises(StateMismatch, match="keys differ"):
        restore(
            {"optimizer": sgd(_params(), lr=0.1, momentum=0.9)},
            {"optimizer": a.state_dict()},
            only=("optimizer",),
        )
    s = sgd(_params(), lr=0.1, momentum=0.9)
    s.step(_grads(0))
    with pytest.raises(StateMismatch, match="keys differ"):
        restore(
            {"optimizer": adam(_params(), lr=0.01)},
            {"optimizer": s.state_dict()},
            only=("optimizer",),
        )


@pytest.mark.parametrize("cls,kw", ROUND_TRIP)
def test_params_handed_over_as_a_dictconfig_become_a_plain_dict_of_the_same_arrays(cls, kw):
    """hydra.utils.instantiate wraps a dict kwarg in a DictConfig (as build_state passes model.params)."""
    from hydra.utils import instantiate

    params = _params()
    opt = instantiate({"_target_": f"{cls.__module__}.{cls.__name__}", **kw}, params=params)
    assert type(opt.params) is dict and list(opt.params) == list(params)
    assert all(opt.params[k] is p for k, p in params.items())
    before = {k: p.copy() for k, p in params.items()}
    opt.step(_grads(0))
    assert all(
        not np.array_equal(before[k], p) for k, p in params.items()
    )  # the caller's arrays moved


class _PlainAdam(Adam):
    """Adam's update as the plain numpy expressions (five temporaries a parameter): the bitwise oracle."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._flat = None  # one parameter at a time through _update below, never Adam's flat path
        self.on_matrices = kw["weight_decay_on"] == "matrices"

    def _update(self, name, p, g):
        dt = p.dtype.type
        if self.weight_decay and (p.ndim >= 2 or not self.on_matrices):
            if self.decoupled:
                p *= dt(1 - self.lr * self.weight_decay)
            else:
                g = g + dt(self.weight_decay) * p
        m, v = self._buffer("exp_avg", name), self._buffer("exp_avg_sq", name)
        m += (g - m) * dt(1 - self.beta1)
        v *= dt(self.beta2)
        v += dt(1 - self.beta2) * g * g
        denom = np.sqrt(v) / dt(math.sqrt(1 - self.beta2**self.t)) + dt(self.eps)
        p -= dt(self.lr / (1 - self.beta1**self.t)) * (m / denom)


class _PlainAdamW(_PlainAdam):
    decoupled = True


@pytest.mark.parametrize(
    "cls, ref_cls, wd, on",
    [
        (Adam, _PlainAdam, 0.0, "all"),
        (Adam, _PlainAdam, 0.1, "all"),
        (AdamW, _PlainAdamW, 0.1, "all"),
        (Adam, _PlainAdam, 0.1, "matrices"),
        (AdamW, _PlainAdamW, 0.1, "matrices"),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_update_is_bitwise_the_plain_expressions(cls, ref_cls, wd, on, dtype):
    g = np.random.default_rng(3)
    shapes = {"a": (5, 7), "b": (7,), "c": (), "d": (3, 2)}
    params = {k: g.normal(size=s).astype(dtype) for k, s in shapes.items()}
    ref_params = {k: v.copy() for k, v in params.items()}
    kw = {**ADAM_DEFAULTS, "lr": 0.01, "weight_decay": wd, "weight_decay_on": on}
    opt, ref = cls(params, **kw), ref_cls(ref_params, **kw)
    for lr in (0.01, 0.02, 0.005, 0.01):
        grads = {k: g.normal(size=s).astype(dtype) for k, s in shapes.items()}
        opt.lr = ref.lr = lr
        opt.step({k: v.copy() for k, v in grads.items()})
        ref.step(grads)
    for k in shapes:
        assert params[k].dtype == dtype and params[k].tobytes() == ref_params[k].tobytes(), k
    a, b = opt.state_dict(), ref.state_dict()
    assert a["t"] == b["t"] and list(a) == list(b)
    for key in ("exp_avg", "exp_avg_sq"):
        assert list(a[key]) == list(b[key])
        assert all(a[key][n].tobytes() == b[key][n].tobytes() for n in a[key]), key
