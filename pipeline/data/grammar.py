"""A deterministic English verb-grammar corpus whose subjects fix verb forms several words later."""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import namedtuple
from functools import partial
from itertools import accumulate
from typing import ClassVar

import numpy as np

from pipeline.data.corpus import CorpusContent, TokenDataset

GRAMMAR_VERSION = 1  # in the hashed params: bump it when the grammar's output for a seed changes
EOS, COMMA = "<eos>", ","


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Agreement is carried as the pronoun a subject stands for: it fixes person, number and gender at once.
# subject, object, possessive, reflexive
_PRONOUNS = "I me my myself, you you your yourself, he him his himself, she her her herself"
_PRONOUNS += ", it it its itself, we us our ourselves, they them their themselves"
PRONOUNS = {forms[0]: forms for forms in map(_words, _PRONOUNS.split(", "))}
THIRD_SINGULAR = ("he", "she", "it")

_NOUNS = (  # class, "singular plural pronoun-its-singular-stands-for" of each noun, one class a noun
    ("person", "man men he, woman women she, boy boys he, girl girls she"),
    ("person", "king kings he, queen queens she"),
    ("animal", "dog dogs it, cat cats it, bird birds it, horse horses it"),
    ("animal", "mouse mice it, fox foxes it"),
    ("food", "apple apples it, cake cakes it, egg eggs it, orange oranges it"),
    ("text", "book books it, letter letters it, story stories it, poem poems it"),
    ("vehicle", "car cars it, bike bikes it, boat boats it"),
    ("thing", "ball balls it, box boxes it, key keys it, cup cups it, hat hats it"),
)
# (singular, plural, pronoun, class)
NOUNS = tuple((*n.split(), cls) for cls, nouns in _NOUNS for n in nouns.split(", "))
ANIMATE, INANIMATE = ("person", "animal"), ("food", "text", "vehicle", "thing")

ATTRIBUTIVE = {
    "animate": _words("tall young old small big little lazy clever brave happy"),
    "inanimate": _words("old small big new red blue green heavy cheap little"),
}
PREDICATIVE = {
    "animate": _words("happy hungry tired angry sad sick clever"),
    "inanimate": _words("new old broken heavy cheap red clean dirty"),
}

Verb = namedtuple("Verb", "base s past ing pp objects reflexive")  # objects () if intransitive
_VERBS = (  # object noun classes (none: intransitive), "base s past ing pp" each, "+self": reflexive
    ((), "run runs ran running run, sleep sleeps slept sleeping slept"),
    ((), "sing sings sang singing sung, laugh laughs laughed laughing laughed"),
    ((), "swim swims swam swimming swum, walk walks walked walking walked"),
    ((), "jump jumps jumped jumping jumped"),
    (("food",), "eat eats ate eating eaten, cook cooks cooked cooking cooked"),
    (("food", "text", "vehicle", "thing"), "buy buys bought buying bought"),
    (("text",), "read reads read reading read, write writes wrote writing written"),
    (("vehicle",), "drive drives drove driving driven"),
    (("vehicle", "thing", "animal"), "wash washes washed washing washed +self"),
    (ANIMATE + INANIMATE, "see sees saw seeing seen +self, like likes liked liking liked +self"),
    (("person", "animal", "text", "thing"), "find finds found finding found"),
    (ANIMATE, "chase chases chased chasing chased, help helps helped helping helped +self"),
    (ANIMATE, "call calls called calling called"),
    (("food", "text", "thing", "animal"), "carry carries carried carrying carried"),
    (("text", "thing"), "open opens opened opening opened"),
)
VERBS = tuple(Verb._make((*v.split()[:5], c, "+" in v)) for c, s in _VERBS for v in s.split(","))
INTRANSITIVE = tuple(v for v in VERBS if not v.objects)
TRANSITIVE = tuple(v for v in VERBS if v.objects)

FUNCTION_WORDS = _words("a an that not very will be been do does did am is are was were has have")


def vocabulary() -> list[str]:
    """Every word the grammar can emit, fixed by the lexicon (not by a sample), specials first."""
    words = {*FUNCTION_WORDS, *PLACE.items, *PREPOSITION.items, *PLACE_PREPOSITION.items}
    words |= {w for n in NOUNS for w in n[:2]} | {w for forms in PRONOUNS.values() for w in forms}
    words |= {w for table in (ATTRIBUTIVE, PREDICATIVE) for adjs in table.values() for w in adjs}
    words |= {d for c in DETERMINER.values() for d in c.items} | {w for v in VERBS for w in v[:5]}
    words |= {w for c in TIME_PHRASE.values() for p in c.items for w in p}
    return [EOS, COMMA, *sorted(words)]


class Choice:
    """A fixed weighted choice: cumulative weights for bisect and each item's log-probability."""

    __slots__ = ("cum", "items", "logp", "total")

    def __init__(self, items, weights=None):
        pairs = [(it, float(w)) for it, w in zip(items, weights or [1.0] * len(items)) if w > 0]
        self.items, self.cum = tuple(it for it, _ in pairs), tuple(accumulate(w for _, w in pairs))
        self.total = self.cum[-1]
        self.logp = tuple(math.log(w / self.total) for _, w in pairs)


def _coin(p: float) -> Choice:
    return Choice((True, False), (p, 1.0 - p))


class _Sampler:
    """Draws by rng.random() only (stable across Pythons, unlike choices()), summing the derivation's log-prob."""

    def __init__(self, rng: random.Random):
        self.rng, self.logp = rng, 0.0

    def draw(self, c: Choice):
        # Rounding can put u at the total: the last item is taken then.
        i = min(bisect_right(c.cum, self.rng.random() * c.total), len(c.items) - 1)
        self.logp += c.logp[i]
        return c.items[i]

    def uniform(self, items):
        self.logp -= math.log(len(items))
        return items[min(int(self.rng.random() * len(items)), len(items) - 1)]

    def distinct(self, items, k: int) -> list:
        pool = list(items)
        return [pool.pop(self.uniform(range(len(pool)))) for _ in range(k)]


ADJECTIVES_OF = {c: "animate" if c in ANIMATE else "inanimate" for c in ANIMATE + INANIMATE}
# Every choice the grammar makes, with its weights, in one place.
NUMBER = Choice(("sg", "pl"))
N_ADJECTIVES = {m: Choice(range(m + 1), (4, 3.5, 2, 0.5)[: m + 1]) for m in (1, 3)}
DETERMINER = {
    "sg": Choice(("the", "a", "this", "that", "every"), (5, 2, 1, 1, 1)),
    "pl": Choice(("the", "these", "those", "some", "two", "three"), (5, 1.5, 1.5, 1, 0.5, 0.5)),
}
NOUNS_OF = {c: Choice([n for n in NOUNS if n[3] == c]) for c in ANIMATE + INANIMATE}
TENSE = Choice(("present", "past", "future", "progressive", "perfect"), (3, 2.5, 1.5, 1.5, 1.5))
TIME_PLACE = Choice(("start", "end", "none"), (3.5, 3.5, 3))
# Time phrases fix the tense from the sentence's first or last words, far from the verb.
TIME_PHRASE = {
    "present": Choice((("often",), ("usually",), ("every", "day"))),
    "past": Choice((("yesterday",), ("last", "week"), ("last", "night"))),
    "future": Choice((("tomorrow",), ("next", "week"), ("soon",))),
    "progressive": Choice((("now",), ("right", "now"))),
    "perfect": Choice((("already",), ("recently",))),
}
PRONOUN = Choice(tuple(PRONOUNS))
SUBJECT_IS_PRONOUN, INNER_SUBJECT_IS_PRONOUN = _coin(0.3), _coin(0.3)
SUBJECT_CLASSES = Choice((ANIMATE, INANIMATE), (4, 1))
POSTMODIFIER = Choice(("none", "pp", "rc"), (4, 2.5, 3.5))
PREPOSITION = Choice(("near", "with", "behind"))
PLACE_PREPOSITION = Choice(("in", "near", "behind"))
PLACE = Choice(("park", "garden", "house", "kitchen", "school", "forest"))
PP_CLASSES = ("person", "animal", "vehicle", "thing")
SUBJECT_RELATIVE = _coin(0.4)
NEGATED, COPULA, VERY = _coin(0.15), _coin(0.2), _coin(0.2)
INTRANSITIVE_VP, PLACE_PP = _coin(0.35), _coin(0.5)
INTRANSITIVE_VERB, TRANSITIVE_VERB = Choice(INTRANSITIVE), Choice(TRANSITIVE)
VERB_TAKING = {c: Choice([v for v in TRANSITIVE if c in v.objects]) for c in ANIMATE + INANIMATE}
OBJECT_KINDS = ("reflexive", "possessive", "pronoun", "np")
OBJECT_KIND = {
    v.base: Choice(OBJECT_KINDS, (1.5 * v.reflexive, 2.5, 1.0 * (v.objects == ANIMATE), 5))
    for v in TRANSITIVE
}
_CLASS_SETS = {v.objects for v in TRANSITIVE} | {ANIMATE, INANIMATE, PP_CLASSES}
CLASS_OF = {cs: Choice(cs) for cs in _CLASS_SETS}
OBJECT_PRONOUN = {
    a: Choice([PRONOUNS[p][1] for p in PRONOUNS if p not in (a, "it")]) for a in PRONOUNS
}
PREDICATE = {k: Choice(adjs) for k, adjs in PREDICATIVE.items()}


def _noun_phrase(s: _Sampler, classes: tuple, max_adjectives: int) -> tuple[list[str], str, str]:
    # -> words, agreement pronoun, noun class
    number, cls = s.draw(NUMBER), s.draw(CLASS_OF[classes])
    sg, pl, pron, _ = s.draw(NOUNS_OF[cls])
    adjs = s.distinct(ATTRIBUTIVE[ADJECTIVES_OF[cls]], s.draw(N_ADJECTIVES[max_adjectives]))
    det = s.draw(DETERMINER[number])
    words = [*adjs, sg if number == "sg" else pl]
    if det == "a" and words[0][0] in "aeiou":
        det = "an"  # fixed by the next word: no draw
    return [det, *words], pron if number == "sg" else "they", cls


def _finite(verb: Verb | None, agr: str, tense: str, negated: bool) -> list[str]:
    """The verb group (verb None: the copula) for a subject standing for pronoun `agr`, its finite word first."""
    neg, third = ["not"] if negated else [], agr in THIRD_SINGULAR
    if tense == "future":
        return ["will", *neg, verb.base if verb else "be"]
    if tense == "perfect":
        return ["has" if third else "have", *neg, verb.pp if verb else "been"]
    if verb is None or tense == "progressive":  # a form of be first
        was = "was" if agr == "I" or third else "were"
        be = was if tense == "past" else "am" if agr == "I" else "is" if third else "are"
        return [be, *neg, verb.ing] if verb else [be, *neg]
    if negated:  # do-support
        return ["did" if tense == "past" else "does" if third else "do", "not", verb.base]
    return [verb.past if tense == "past" else verb.s if third else verb.base]


def _relative_clause(s: _Sampler, head_agr: str, head_cls: str, tense: str) -> list[str]:
    # Inner verbs take the simple tense of the main clause; their own subject is an attractor.
    inner_tense = "past" if tense == "past" else "future" if tense == "future" else "present"
    if head_cls in ANIMATE and s.draw(SUBJECT_RELATIVE):  # "the dogs that chase the cat"
        verb = s.draw(TRANSITIVE_VERB)
        obj, _, _ = _noun_phrase(s, verb.objects, 1)
        return ["that", *_finite(verb, head_agr, inner_tense, False), *obj]
    # object relative: "the dogs that the cat chases"; the inner verb must accept the head as object
    if s.draw(INNER_SUBJECT_IS_PRONOUN):  # a pronoun is named by its subject form
        subj = [agr := s.draw(PRONOUN)]
    else:
        subj, agr, _ = _noun_phrase(s, ANIMATE, 1)
    verb = s.draw(VERB_TAKING[head_cls])
    return ["that", *subj, *_finite(verb, agr, inner_tense, False)]


def _subject(s: _Sampler, tense: str) -> tuple[list[str], str, str, int]:
    # -> words, agreement pronoun, class, index of the word that fixes agreement
    if s.draw(SUBJECT_IS_PRONOUN):
        return [agr := s.draw(PRONOUN)], agr, "animal" if agr == "it" else "person", 0
    words, agr, cls = _noun_phrase(s, s.draw(SUBJECT_CLASSES), 3)
    head, post = len(words) - 1, s.draw(POSTMODIFIER)
    if post == "pp":  # "the dogs near the old man": the nearer noun is an attractor
        obj, _, _ = _noun_phrase(s, PP_CLASSES, 1)
        words += [s.draw(PREPOSITION), *obj]
    elif post == "rc":
        words += _relative_clause(s, agr, cls, tense)
    return words, agr, cls, head


def _object(s: _Sampler, verb: Verb, agr: str) -> list[str]:
    kind = s.draw(OBJECT_KIND[verb.base])
    if kind == "reflexive":
        return [PRONOUNS[agr][3]]
    if kind == "pronoun":  # never the subject's own person: that would be the reflexive
        return [s.draw(OBJECT_PRONOUN[agr])]
    words, _, _ = _noun_phrase(s, verb.objects, 1)
    if kind == "possessive":  # "the girls ... wash their cars": the owner is the subject
        words[0] = PRONOUNS[agr][2]
    return words


def sentence(s: _Sampler) -> tuple[list[str], dict]:
    """One sentence (without the end token) and where its subject fixes its verb."""
    tense, where = s.draw(TENSE), s.draw(TIME_PLACE)
    time_words = list(s.draw(TIME_PHRASE[tense])) if where != "none" else []
    words = [*time_words, COMMA] if where == "start" else []
    subj, agr, cls, head = _subject(s, tense)
    head, words = head + len(words), words + subj
    negated, verb_at = s.draw(NEGATED), len(words)
    if cls in INANIMATE or s.draw(COPULA):
        words += _finite(None, agr, tense, negated)
        words += ["very"] if s.draw(VERY) else []
        words.append(s.draw(PREDICATE[ADJECTIVES_OF[cls]]))
    elif s.draw(INTRANSITIVE_VP):
        words += _finite(s.draw(INTRANSITIVE_VERB), agr, tense, negated)
        words += [s.draw(PLACE_PREPOSITION), "the", s.draw(PLACE)] if s.draw(PLACE_PP) else []
    else:
        verb = s.draw(TRANSITIVE_VERB)
        words += [*_finite(verb, agr, tense, negated), *_object(s, verb, agr)]
    words += time_words if where == "end" else []
    return words, {"subject_head": head, "verb": verb_at, "agreement": agr, "tense": tense}


def generate(seed: int, n_sentences: int) -> tuple[list[list[str]], list[dict], list[float]]:
    """Sentences, their agreement metadata and log-probabilities: a pure function of (seed, n_sentences)."""
    s, rows = _Sampler(random.Random(int(seed))), []
    for _ in range(int(n_sentences)):
        s.logp = 0.0
        rows.append((*sentence(s), s.logp))  # the sentence's draws, then their log-probability
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def token_stream(sentences: list[list[str]], index: dict[str, int]) -> np.ndarray:
    """[n_tokens] int64: every sentence's words, each followed by the end token."""
    return np.asarray([index[w] for words in sentences for w in (*words, EOS)], dtype=np.int64)


def build_grammar_corpus(seed: int, n_sentences: int, val_fraction: float) -> CorpusContent:
    vocab = vocabulary()
    index = {w: i for i, w in enumerate(vocab)}
    sentences, _, logps = generate(seed, n_sentences)
    n_val = max(1, round(n_sentences * val_fraction))
    if n_val >= n_sentences:
        raise ValueError(
            f"n_sentences={n_sentences} leaves no training sentences at val_fraction={val_fraction}"
        )
    train, val = token_stream(sentences[:-n_val], index), token_stream(sentences[-n_val:], index)
    # The generator's own log-probability of each sentence bounds what any model can reach on it; a bound
    # from above, since a rare string with two derivations (e.g. "read" present/past) is charged for one.
    stats: dict = {"sentences": {"train": n_sentences - n_val, "val": n_val}}
    stats["oracle_val_ppl_bound"] = round(math.exp(-math.fsum(logps[-n_val:]) / len(val)), 4)
    return CorpusContent(vocab, join=" ", pieces=(("train", train), ("val", val)), stats=stats)


class GrammarCorpus(TokenDataset):
    """`data=grammar`: the grammar corpus under <output_dir>/data/grammar-<hash>/, generated once."""

    specials: ClassVar[dict[str, str]] = {"eos": EOS}  # ends each sentence: prompts start after it

    def __init__(
        self,
        cache_dir: str,
        seed: int,
        n_sentences: int,
        val_fraction: float,
        block_size: int,
        ngram_order: int,
        val_batch_size: int,
    ):
        params = {"generator": "grammar", "version": GRAMMAR_VERSION, "seed": int(seed)}
        params.update(n_sentences=int(n_sentences), val_fraction=float(val_fraction))
        params.update(block_size=int(block_size), ngram_order=int(ngram_order))
        build = partial(build_grammar_corpus, int(seed), int(n_sentences), float(val_fraction))
        super().__init__(cache_dir, params, val_batch_size, build)
