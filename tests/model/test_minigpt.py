"""MiniGPT: whole-model gradient check, tied head, causality, init, HF layout, determinism, dtypes."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from pipeline.data.base import Batch, DataSpec
from pipeline.model.losses import cross_entropy
from pipeline.model.minigpt import MiniGPT

WTE = "transformer.wte.weight"
TOL = 1e-6  # max relative error of the gradient check
# |a| + |b| below this is judged absolutely (e.g. the k-bias gradient, exactly 0 by softmax shift invariance)
FLOOR = 1e-6


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a) + np.abs(b), FLOOR)))


def numeric_grad(f, x: np.ndarray, h: float = 1e-3) -> np.ndarray:
    # Fourth-order central differences of the scalar loss. The loss (~ln V) carries ~1e-16 relative rounding,
    # which a two-point stencil with eps 1e-6 turns into ~1e-10 absolute noise; this stencil's error is
    # O(h^4) + O(1e-16 / h), ~1e-13 here.
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        vals = []
        for step in (-2, -1, 1, 2):
            flat[i] = old + step * h
            vals.append(f())
        flat[i] = old
        gflat[i] = (vals[0] - 8 * vals[1] + 8 * vals[2] - vals[3]) / (12 * h)
    return g


# What these tests build unless they say otherwise (the class has no defaults: conf/model/minigpt.yaml's values)
BASE = dict(
    n_layer=2,
    n_head=4,
    n_embd=64,
    block_size=None,
    dropout=0.0,
    attn_dropout=None,
    init_std=0.02,
    bias=True,
    gelu="tanh",
    dtype="float32",
)


def make(vocab=11, seed=0, **kw) -> MiniGPT:
    kw = {**BASE, **kw}
    spec = DataSpec(
        vocab_size=vocab, block_size=kw["block_size"] or 64
    )  # sequences as long as the positions
    return MiniGPT(spec, rng=np.random.default_rng(seed), **kw)


def tiny(dropout=0.0) -> MiniGPT:
    # Larger init and randomised LayerNorm/bias values: gradients of O(1e-3..1), away from the symmetric init.
    m = make(
        n_layer=2, n_head=2, n_embd=8, block_size=6, dropout=dropout, init_std=0.3, dtype="float64"
    )
    r = np.random.default_rng(1)
    for name, p in m.params.items():
        if "ln_" in name or name.endswith("bias"):
            p += 0.1 * r.standard_normal(p.shape)
    return m


def batch(vocab, B, T, seed=2) -> Batch:
    r = np.random.default_rng(seed)
    return Batch(ids=np.arange(B), x=r.integers(0, vocab, (B, T)), y=r.integers(0, vocab, (B, T)))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_whole_model_gradient_check(dropout):
    m, b = tiny(dropout), batch(11, B=2, T=5)  # T < block_size: the last wpe row must get exactly 0

    def loss():  # a fresh same-seed generator: every evaluation draws the same dropout masks
        if not dropout:
            return m.evaluate(b)
        logits, _ = m._forward(
            np.asarray(b.x), np.random.default_rng(5)
        )  # loss_and_grads' forward, no backward
        return cross_entropy(logits, np.asarray(b.y).reshape(-1), overwrite=True)[0]

    _, grads = m.loss_and_grads(b, np.random.default_rng(5) if dropout else None)
    assert list(grads) == list(m.params)
    for name, p in m.params.items():
        assert rel_err(grads[name], numeric_grad(loss, p)) < TOL, name
    assert np.all(grads["transformer.wpe.weight"][5] == 0)


@pytest.mark.parametrize(("bias", "gelu"), [(False, "tanh"), (True, "erf"), (False, "erf")])
def test_bias_free_and_erf_models_gradient_check(bias, gelu):
    m, b = (
        make(
            n_layer=2,
            n_head=2,
            n_embd=8,
            block_size=6,
            init_std=0.3,
            dtype="float64",
            bias=bias,
            gelu=gelu,
        ),
        batch(11, B=2, T=5),
    )
    r = np.random.default_rng(1)
    for name, p in m.params.items():
        if "ln_" in name or name.endswith("bias"):
            p += 0.1 * r.standard_normal(p.shape)
    assert bias or not any(name.endswith(".bias") for name in m.params)
    counted = MiniGPT.n_params(
        DataSpec(vocab_size=11, block_size=6), n_layer=2, n_embd=8, block_size=6, bias=bias
    )
    assert sum(p.size for p in m.params.values()) == counted
    _, grads = m.loss_and_grads(b, None)
    assert list(grads) == list(m.params)
    for name, p in m.params.items():
        assert rel_err(grads[name], numeric_grad(lambda: m.evaluate(b), p)) < TOL, name


def test_a_bias_free_model_is_the_biased_one_with_zero_biases():
    # The same draws in the same order: the weights equal, and the logits equal those of zero biases.
    free, full = make(n_embd=16, n_head=2, bias=False), make(n_embd=16, n_head=2, bias=True)
    assert all(np.array_equal(p, full.params[name]) for name, p in free.params.items())
    x = np.random.default_rng(3).integers(0, 11, (2, 7))
    np.testing.assert_array_equal(free.logits(x), full.logits(x))  # GPT-2's init: every bias is 0


class _Untied(MiniGPT):
    """The same model with the head given its own array: the two uses of wte can be perturbed apart."""

    @property
    def lm_head(self) -> np.ndarray:
        return self.head


def test_tied_gradient_is_sum_of_embedding_and_head_uses():
    m, b = tiny(), batch(11, B=2, T=5)
    _, grads = m.loss_and_grads(b, None)
    u = copy.deepcopy(m)
    u.__class__ = _Untied
    u.head = u.params[WTE].copy()
    assert u.evaluate(b) == m.evaluate(b)
    emb_use = numeric_grad(lambda: u.evaluate(b), u.params[WTE])  # [V, d] embedding lookup only
    head_use = numeric_grad(lambda: u.evaluate(b), u.head)  # [V, d] output projection only
    assert np.abs(emb_use).max() > 1e-3 and np.abs(head_use).max() > 1e-3
    assert rel_err(grads[WTE], emb_use + head_use) < TOL
    assert rel_err(grads[WTE], head_use) > 1e-2  # the check would catch a dropped term


def test_tied_head_is_one_array_through_updates():
    m, b = make(vocab=32, n_embd=16, n_head=2, block_size=8), batch(32, B=4, T=8)
    wte = m.params[WTE]
    assert m.aliases == {"lm_head.weight": WTE}
    assert "lm_head.weight" not in m.params
    for _ in range(3):  # optimizer-like in-place updates
        _, g = m.loss_and_grads(b, None)
        for name, p in m.params.items():
            p -= 0.1 * g[name]
    sd = m.state_dict()
    assert m.params[WTE] is wte and m.lm_head is wte and sd["lm_head.weight"] is wte
    # The head reads the updated values: a copy whose head is a snapshot of the live wte agrees bitwise.
    u = copy.deepcopy(m)
    u.__class__ = _Untied
    u.head = wte.copy()
    np.testing.assert_array_equal(u.logits(b.x), m.logits(b.x))
    m.load_state_dict({k: v.copy() for k, v in sd.items()})
    assert m.params[WTE] is wte and m.state_dict()["lm_head.weight"] is wte


def test_parameter_names_and_layouts_match_hugging_face_gpt2():
    V, T, d, n = 13, 7, 16, 3
    m = make(vocab=V, n_layer=n, n_head=4, n_embd=d, block_size=T)
    want = {WTE: (V, d), "transformer.wpe.weight": (T, d)}
    for i in range(n):
        h = f"transformer.h.{i}."
        want.update(
            {
                h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
                h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                h + "mlp.c_fc.weight": (d, 4 * d), h + "mlp.c_fc.bias": (4 * d,),
                h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,),
            }
        )  # fmt: skip
    want.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    assert {k: v.shape for k, v in m.params.items()} == want
    assert all(p.dtype == np.float32 and p.flags.c_contiguous for p in m.params.values())


def test_gpt2_init_statistics():
    m = make(vocab=512, n_layer=2, n_embd=64)
    p = m.params
    assert abs(p[WTE].std() - 0.02) < 0.001
    assert abs(p["transformer.h.0.attn.c_attn.weight"].std() - 0.02) < 0.001
    for name in ("transformer.h.1.attn.c_proj.weight", "transformer.h.1.mlp.c_proj.weight"):
        assert abs(p[name].std() - 0.02 / math.sqrt(4)) < 0.0006, name
    for name, a in p.items():
        if name.endswith("bias"):
            assert np.all(a == 0), name
        elif "ln_" in name:
            assert np.all(a == 1), name


def test_init_draws_only_from_the_given_rng():
    a, b = make(seed=3), make(seed=3)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not np.array_equal(a.params[WTE], make(seed=4).params[WTE])
    f64 = make(seed=3, dtype="float64")  # same draws, only rounded differently
    assert all(np.array_equal(f64.params[k].astype(np.float32), a.params[k]) for k in a.params)
    with pytest.raises(ValueError, match="MiniGPT needs rng"):
        MiniGPT(DataSpec(vocab_size=11), **BASE, rng=None)  # no hidden default seed


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_loss_at_init_is_log_vocab(dtype):
    m, b = make(vocab=512, dtype=dtype), batch(512, B=32, T=64)
    loss = m.evaluate(b)
    assert abs(loss - math.log(512)) < 0.05 * math.log(512)


def test_causal_logits_ignore_future_tokens():
    m = make(vocab=512, dropout=0.1)
    x = np.random.default_rng(7).integers(0, 512, (2, 64))
    base = m.logits(x)
    assert base.shape == (2, 64, 512) and base.dtype == np.float32
    for t in (0, 17, 62):
        x2 = x.copy()
        x2[:, t + 1] = (x2[:, t + 1] + 1) % 512
        out = m.logits(x2)
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])  # bitwise
        assert not np.array_equal(out[:, t + 1], base[:, t + 1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_determinism_and_dtypes(dtype):
    m, b = make(vocab=64, dropout=0.1, dtype=dtype), batch(64, B=4, T=16)
    l1, g1 = m.loss_and_grads(b, np.random.default_rng(9))
    l2, g2 = m.loss_and_grads(b, np.random.default_rng(9))
    assert isinstance(l1, float) and l1 == l2
    assert list(g1) == list(m.params)
    for k, p in m.params.items():
        assert g1[k].dtype == p.dtype and g1[k].shape == p.shape, k
        assert np.array_equal(g1[k], g2[k]), k
    l3, _ = m.loss_and_grads(b, np.random.default_rng(10))
    assert l3 != l1  # dropout is live in training
    assert m.loss_and_grads(b, None)[0] == m.evaluate(b)  # no rng: no dropout
    assert m.logits(b.x).dtype == np.dtype(dtype)


def test_sequence_length_limits():
    m = make(vocab=11, block_size=8, n_embd=16, n_head=2)
    m.evaluate(batch(11, B=2, T=3))  # shorter than block_size is fine
    with pytest.raises(ValueError, match="sequence length 9 exceeds the 8 learned positions"):
        m.evaluate(batch(11, B=2, T=9))


def test_float32_model_has_no_float64_array_anywhere():
    # No silent upcasts: every float array the forward keeps for the backward, and every gradient, is float32.
    m, b = make(vocab=64, n_embd=16, n_head=2, block_size=16, dropout=0.1), batch(64, B=4, T=16)
    logits, caches = m._forward(np.asarray(b.x), np.random.default_rng(0))

    def floats(obj):
        if isinstance(obj, np.ndarray):
            yield obj
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                yield from floats(o)

    kept = [a for a in floats(caches) if a.dtype.kind == "f"]
    assert len(kept) > 30 and {a.dtype for a in kept} == {np.dtype(np.float32)}
    assert logits.dtype == np.float32
    _, grads = m.loss_and_grads(b, np.random.default_rng(0))
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float32)}
