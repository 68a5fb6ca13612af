"""The Kneser-Ney baseline: a proper distribution, equal to a plain-Python reference, and a real baseline."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from conftest import ngram_distribution, ngram_fit, ngram_log_probs, ngram_perplexity
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.data import corpus, grammar


def _reference_prob(tokens, order, V, discounts, history, w):
    """Interpolated modified Kneser-Ney written out with dicts, for small data."""
    tokens = list(tokens)
    grams = {
        k: Counter(tuple(tokens[i : i + k]) for i in range(len(tokens) - k + 1))
        for k in range(1, order + 2)
    }

    def counts(k):  # raw counts at the top order, continuation counts below
        if k == order:
            return grams[k]
        return Counter(g[1:] for g in grams[k + 1])

    def d(k, c):
        d1, d2, d3 = discounts[k - 1]
        return 0.0 if c == 0 else d1 if c == 1 else d2 if c == 2 else d3

    p = 1.0 / V
    for k in range(1, order + 1):
        if k - 1 > len(history):
            break
        ctx = tuple(history[len(history) - (k - 1) :]) if k > 1 else ()
        c_k = counts(k)
        after = {g: c for g, c in c_k.items() if g[:-1] == ctx}
        total = sum(after.values())
        if total == 0:
            continue
        freed = sum(d(k, c) for c in after.values())
        c = after.get((*ctx, w), 0)
        p = (max(c - d(k, c), 0.0) + freed * p) / total
    return p


@pytest.fixture(scope="module")
def small_corpus():
    sentences, _, _ = grammar.generate(4, 400)
    index = {w: i for i, w in enumerate(grammar.vocabulary())}
    return grammar.token_stream(sentences, index), len(index)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_distribution_sums_to_one(small_corpus, order):
    tokens, V = small_corpus
    lm = ngram_fit(tokens, order, V)
    histories = [
        [],
        tokens[:3],
        tokens[100:110],
        [V - 1, V - 2, V - 3],
        [0, 0, 0, 0],
    ]  # seen, unseen, short
    for h in histories:
        p = ngram_distribution(lm, V, h)
        assert p.shape == (V,)
        assert np.all(p > 0)
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=6, max_size=60),
    st.integers(1, 4),
    st.lists(st.integers(0, 5), max_size=4),
)
@example(
    [4, 2, 0, 2, 3, 4, 2, 4, 2, 1, 0, 2], 2, [0]
)  # D2 estimated <= 0: every bigram after 0 a count-2 one
def test_any_stream_gives_a_distribution(tokens, order, history):
    lm = ngram_fit(np.array(tokens), order, 6)
    p = ngram_distribution(lm, 6, history)
    assert np.all(p > 0) and math.isclose(p.sum(), 1.0, rel_tol=1e-9)


def test_matches_plain_python_reference():
    rng = np.random.default_rng(0)
    V, order = 7, 3
    tokens = rng.integers(0, V, 300) * (
        rng.random(300) < 0.7
    )  # skewed, so counts of all sizes occur
    lm = ngram_fit(tokens, order, V)
    discounts = [level.discounts for level in lm]
    for h in ([], [3], [1, 2], [0, 0], [6, 6], list(tokens[10:12])):
        expected = [_reference_prob(tokens, order, V, discounts, h, w) for w in range(V)]
        np.testing.assert_allclose(ngram_distribution(lm, V, h), expected, rtol=1e-12)


def test_stream_log_probs_use_the_preceding_tokens_of_the_stream(small_corpus):
    tokens, V = small_corpus
    lm = ngram_fit(tokens[:2000], 3, V)
    positions = np.array([0, 1, 2, 50, 51])
    got = ngram_log_probs(lm, V, tokens, positions)
    for lp, i in zip(got, positions):
        expected = ngram_distribution(lm, V, tokens[max(0, i - 2) : i])[tokens[i]]
        assert math.isclose(lp, math.log(expected), rel_tol=1e-12)


def test_val_perplexity_is_a_meaningful_baseline():
    content = grammar.build_grammar_corpus(9, 6000, 0.1)
    tokens = dict(content.pieces)
    V, positions = len(content.vocab), corpus.val_target_positions(len(tokens["val"]), 64)
    ppl = {
        n: ngram_perplexity(ngram_fit(tokens["train"], n, V), V, tokens["val"], positions)
        for n in (1, 3)
    }
    assert all(math.isfinite(p) and p > 1 for p in ppl.values())
    assert ppl[3] < 0.6 * ppl[1]  # context helps an n-gram a lot on this grammar
    assert (
        ppl[3] > content.stats["oracle_val_ppl_bound"]
    )  # ... yet it stays above what the grammar allows


def test_order_too_high_for_the_key_width_is_refused():
    with pytest.raises(ValueError, match="order"):
        ngram_fit(np.arange(100) % 500, 8, 500)
