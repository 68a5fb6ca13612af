"""The grammar generator: pure in its seed, a small vocabulary, and agreement that needs more than n-gram context."""

from __future__ import annotations

from collections import defaultdict

from pipeline.data import grammar

# Which subjects (as the pronoun they stand for) each number-marked finite word allows, written out
# independently of the generator's own tables.
THIRD = {"he", "she", "it"}
OTHERS = {"I", "you", "we", "they"}
MARKED = {
    "am": {"I"},
    "is": THIRD,
    "are": {"you", "we", "they"},
    "was": {"I"} | THIRD,
    "were": {"you", "we", "they"},
    "has": THIRD,
    "have": OTHERS,
    "does": THIRD,
    "do": OTHERS,
}
for _v in grammar.VERBS:
    MARKED[_v.s] = THIRD


def _finite_allowed(word: str, tense: str):
    if word in MARKED:
        return MARKED[word]
    if tense == "present":  # a bare present verb excludes the third person singular
        return OTHERS
    return None  # past and future forms do not show agreement


def test_generate_is_a_pure_function_of_the_seed():
    a = grammar.generate(7, 300)
    assert a == grammar.generate(7, 300)
    assert a[0] != grammar.generate(8, 300)[0]


def test_vocabulary_is_small_and_covers_every_generated_word():
    vocab = grammar.vocabulary()
    assert len(vocab) <= 512 and len(vocab) == len(set(vocab))
    assert vocab[0] == grammar.EOS
    sentences, _, _ = grammar.generate(3, 2000)
    used = {w for s in sentences for w in s}
    assert used <= set(vocab)
    assert len(used) > 0.9 * len(vocab)  # the lexicon is really exercised


def test_verbs_agree_with_subjects_several_words_back():
    sentences, meta, _ = grammar.generate(11, 4000)
    distant, contexts = 0, defaultdict(set)
    for words, m in zip(sentences, meta):
        allowed = _finite_allowed(words[m["verb"]], m["tense"])
        if allowed is None:
            continue
        assert m["agreement"] in allowed, (words, m)
        if m["verb"] - m["subject_head"] >= 3:
            distant += 1
            # What a trigram model sees before the verb, and which number the verb had to show.
            contexts[tuple(words[m["verb"] - 2 : m["verb"]])].add(m["agreement"] in THIRD)
    assert distant > 0.1 * len(sentences)
    # The same two words before the verb are followed by both singular and plural forms,
    # so only context beyond them decides: an n-gram model cannot.
    ambiguous = [c for c, numbers in contexts.items() if len(numbers) == 2]
    assert len(ambiguous) >= 20


def test_possessives_and_reflexives_follow_the_subject():
    sentences, meta, _ = grammar.generate(5, 3000)
    checked = 0
    for words, m in zip(sentences, meta):
        _subj, _obj, poss, refl = grammar.PRONOUNS[m["agreement"]]
        for w in words[m["verb"] :]:
            if w in {r for *_, r in grammar.PRONOUNS.values()}:
                assert w == refl, (words, m)
                checked += 1
            if w in {"my", "your", "his", "its", "our", "their"}:
                assert w == poss, (words, m)
                checked += 1
    assert checked > 100


def test_sentences_have_a_single_subject_before_the_verb():
    sentences, meta, _ = grammar.generate(2, 500)
    for words, m in zip(sentences, meta):
        assert 0 <= m["subject_head"] < m["verb"] < len(words)
        assert grammar.EOS not in words
