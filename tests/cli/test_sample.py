"""`python -m pipeline.sample` (pipeline/cli/sample.py): draws by inverse CDF from the command's own Generator (one
uniform per token, the same text for a seed, the global RNG untouched), greedy decoding as the argmax chain,
words and characters through the corpus vocabulary, and one-line refusals."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    KERNODECK,
    TINY,
    pasted,
    refused_in_one_line,
    run_job,
    run_pipeline,
    text_overrides,
    the_run,
)

from pipeline.cli.sample import sample
from pipeline.config.errors import ConfigError
from pipeline.model.generate import encode, next_token, split_prompt
from pipeline.run.directory import RunDir


def trained(out: Path, *overrides: str) -> Path:
    assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
    return RunDir(the_run(out)).store.root / "final"


@pytest.fixture(scope="module")
def tiny(finished_job) -> Path:
    return RunDir(the_run(finished_job(*TINY))).store.root / "final"


def test_a_token_is_the_inverse_cdf_of_one_uniform_draw():
    logits = np.array([0.0, math.log(3.0)])  # p = [1/4, 3/4]
    for seed in range(50):
        u = np.random.default_rng(seed).random()
        assert next_token(logits, 1.0, 0, np.random.default_rng(seed)) == (0 if u < 0.25 else 1)
    # temperature 2 flattens it to p proportional to [1, sqrt 3]
    for seed in range(50):
        u = np.random.default_rng(seed).random()
        assert next_token(logits, 2.0, 0, np.random.default_rng(seed)) == (
            0 if u < 1 / (1 + math.sqrt(3)) else 1
        )
    rng = np.random.default_rng(0)
    counts = np.bincount([next_token(logits, 1.0, 0, rng) for _ in range(4000)], minlength=2)
    assert abs(counts[0] - 1000) < 4 * math.sqrt(4000 * 0.25 * 0.75)
    wide = np.array([1.0, 3.0, 2.0, 3.0, -1.0])
    assert next_token(wide, 0.0, 0, rng) == 1  # greedy: the first maximum, no draw
    assert {next_token(wide, 5.0, 2, rng) for _ in range(200)} == {
        1,
        3,
    }  # top_k=2 keeps the two 3.0s only


def test_prompts_split_as_the_corpus_joins_its_tokens():
    assert split_prompt("the  man ,\twalks", " ") == ["the", "man", ",", "walks"]
    assert split_prompt("ab c\n", "") == ["a", "b", " ", "c", "\n"]
    vocab = ["<eos>", ",", "man", "the"]
    assert encode("the man , the", vocab, " ") == [3, 2, 1, 3]
    assert encode("", vocab, " ") == [0]  # an empty prompt starts after <eos>
    with pytest.raises(
        ConfigError, match=r"not in the corpus vocabulary of 4 tokens: 'woman', 'dogs'"
    ):
        encode("the woman , dogs woman", vocab, " ")
    chars = ["\n", " ", "a", "b"]
    assert encode("", chars, "") == [
        0
    ]  # a character vocabulary without <eos> starts at a newline (nanoGPT's)
    with pytest.raises(
        ConfigError, match=r"no <eos> nor newline to start from: give one, e.g. prompt=a$"
    ):
        encode("", ["a", "b"], "")
    with pytest.raises(ConfigError, match=re.escape("(a newline is typed prompt=$'\\n' in bash)")):
        encode("\\n", chars, "")  # what bash passes for prompt='\n': a backslash and an n


def test_the_same_seed_gives_the_same_text_from_its_own_generator(tiny):
    args = ["prompt=the man", "max_new_tokens=12", "seed=3"]
    np.random.seed(1)
    before = np.random.get_state()[1].copy()
    first = sample(tiny, args)
    assert np.array_equal(np.random.get_state()[1], before)  # the global RNG was not drawn from
    np.random.seed(2)
    assert sample(tiny, args) == first  # nor does its state matter
    assert sample(tiny, ["prompt=the man", "max_new_tokens=12", "seed=4"]) != first
    words = first.split(" ")
    assert words[:2] == ["the", "man"] and len(words) == 14


def test_greedy_decoding_is_the_argmax_chain(tiny):
    from pipeline.run.trained import checkpoint_data, restore_checkpoint

    manifest, state = restore_checkpoint(tiny)
    vocab = checkpoint_data(manifest, [], tiny, own=True).vocab
    ids = [vocab.index("the"), vocab.index("man")]
    for _ in range(6):
        ids.append(int(np.argmax(state.model.logits(np.array([ids]))[0, -1])))
    assert sample(tiny, ["prompt=the man", "max_new_tokens=6", "temperature=0"]) == " ".join(
        vocab[i] for i in ids
    )


def test_a_character_model_samples_characters(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abc de\n" * 100)
    ckpt = trained(tmp_path / "out", *text_overrides(text))
    out = sample(ckpt, ["prompt=ab", "max_new_tokens=20", "seed=1"])
    assert out.startswith("ab") and len(out) == 22 and set(out) <= set("abc de\n")
    with pytest.raises(ConfigError, match="'z'"):
        sample(ckpt, ["prompt=abz"])


def refused(args: list[str], cwd: Path) -> str:
    return refused_in_one_line(args, cwd, module="pipeline.sample")


def test_the_command_and_its_refusals(tiny, tmp_path, finished_job):
    proc = run_pipeline(
        [str(tiny), "prompt=the man , the", "max_new_tokens=5", "seed=7"],
        tmp_path / "cwd",
        module="pipeline.sample",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout == sample(tiny, ["prompt=the man , the", "max_new_tokens=5", "seed=7"]) + "\n"
    )
    assert "'zorg', 'blorp'" in refused([str(tiny), "prompt=the zorg blorp"], tmp_path / "cwd")
    assert "temperature=-1.0: must be >= 0" in refused(
        [str(tiny), "temperature=-1"], tmp_path / "cwd"
    )
    assert "'colour=red': expected one of prompt=" in refused(
        [str(tiny), "colour=red"], tmp_path / "cwd"
    )
    mlp = RunDir(the_run(finished_job(*KERNODECK))).store.root / "final"
    assert "does not generate tokens" in refused([str(mlp), "prompt=x"], tmp_path / "cwd")
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny, damaged)
    (damaged / "extra.json").write_text("{}")
    assert "extra.json" in refused([str(damaged), "prompt=the"], tmp_path / "cwd")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grammar", "text"])
def test_the_printed_sample_line_runs_as_printed(kind, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\nthat is the question\n" * 40)
    job = TINY if kind == "grammar" else text_overrides(text)
    done = run_pipeline([*job, f"paths.output_dir={tmp_path / 'out'}"], tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(
        ln for ln in (done.stdout + done.stderr).splitlines() if ln.lstrip().startswith("sample ")
    )
    drawn = pasted(line.split("sample", 1)[1], tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert drawn.stdout.strip()
