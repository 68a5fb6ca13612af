"""Text from a token model: options, the prompt's tokens, draws from softmax(logits / temperature) (sample, serving)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import numpy as np

from pipeline.config.errors import ConfigError

# One forward pass per token: 100,000 is already minutes of text; more is a typo, refused before any work.
MAX_NEW_TOKENS = 100_000


@dataclass(frozen=True)
class Options:
    prompt: str = ""
    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int = 0


def parse_options(args: list[str]) -> tuple[Options, list[str]]:
    """key=value arguments -> (Options, the data overrides); ConfigError naming a bad one. The prompt is taken
    verbatim (commas and quotes included), not through Hydra's override grammar."""
    values, overrides = {}, []
    kinds = {key: type(default) for key, default in vars(Options()).items()}  # str, int, float ...
    for arg in args:
        key, eq, value = arg.partition("=")
        if (bare := key.lstrip("+~")) == "data" or bare.startswith(("data.", "paths.", "hydra.")):
            overrides.append(arg)
            continue
        if not eq or key not in kinds:
            expected = ", ".join(f"{k}=..." for k in kinds)
            said = f"{arg!r}: expected one of {expected} (or data.path=FILE, paths.output_dir=DIR)"
            raise ConfigError(said)
        try:
            values[key] = kinds[key](value)
        except ValueError:
            kind = "an integer" if kinds[key] is int else "a number"
            raise ConfigError(f"{key}={value!r}: must be {kind}") from None
    options = Options(**values)
    for key, value in vars(options).items():
        if key != "prompt" and not (value >= 0 and np.isfinite(value)):
            raise ConfigError(f"{key}={value!r}: must be >= 0")
    if (n := options.max_new_tokens) > MAX_NEW_TOKENS:
        why = "(one forward pass per token); sample in several calls for more"
        raise ConfigError(f"max_new_tokens={n}: at most {MAX_NEW_TOKENS:,} {why}")
    return options, overrides


def split_prompt(prompt: str, join: str) -> list[str]:
    """The prompt's tokens as the corpus would have them: words for " ", characters for ""."""
    if join == "":
        return list(prompt)
    return prompt.split() if join.isspace() else [t for t in prompt.split(join) if t]


def encode(prompt: str, vocab: list[str], join: str, eos: str | None = "<eos>") -> list[int]:
    """The prompt's ids; an empty prompt is [id of `eos`] (the token every sentence ends with), or for a
    character vocabulary without one [id of a newline] (where nanoGPT's sample.py starts)."""
    index = {t: i for i, t in enumerate(vocab)}
    tokens = split_prompt(prompt, join)
    if unknown := list(dict.fromkeys(t for t in tokens if t not in index)):
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        shown = ", ".join(repr(t) for t in unknown[:10]) + more
        if "\\" in unknown and "\n" in index:
            shown += " (a newline is typed prompt=$'\\n' in bash)"
        raise ConfigError(f"prompt: not in the corpus vocabulary of {len(vocab)} tokens: {shown}")
    if not tokens:
        start = eos if eos in index else "\n" if join == "" and "\n" in index else None
        if start is None:
            nor, first = "nor newline " if join == "" else "", shlex.quote(vocab[0])
            said = f"has no {eos or 'end-of-sentence token'} {nor}to start from: give one"
            raise ConfigError(f"prompt: empty, and this vocabulary {said}, e.g. prompt={first}")
        tokens = [start]
    return [index[t] for t in tokens]


def next_token(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    # logits [V] -> one id; inverse CDF of one uniform draw, so each token costs exactly one draw
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature  # [V]
    if 0 < top_k < z.size:
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)  # ties at the k-th all kept
    cdf = np.cumsum(np.exp(z - z.max()))  # [V]
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), z.size - 1))


def continuation(model, vocab: list[str], join: str, options: Options, eos: str | None = "<eos>"):
    """The prompt and max_new_tokens tokens drawn from `model.logits(x [1, T]) -> [1, T, V]`, as text (what sample
    prints, a registered model's predict returns); an empty prompt starts after `eos` when the vocabulary has one."""
    rng = np.random.default_rng(options.seed)  # this command's own stream, never the global one
    ids = encode(options.prompt, vocab, join, eos)
    for _ in range(options.max_new_tokens):
        logits = model.logits(np.asarray(ids[-model.block_size :], dtype=np.int64)[None, :])
        ids.append(next_token(logits[0, -1], options.temperature, options.top_k, rng))
    return join.join(vocab[i] for i in ids)
