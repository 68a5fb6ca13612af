"""export_hf: the written directory round-trips, and (with torch + transformers) loads as GPT2LMHeadModel, its
tokenizer as AutoTokenizer mapping the corpus vocabulary id for id, and generates through transformers.pipeline."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pipeline.cli.export_hf import main, write_hf
from pipeline.data.base import DataSpec
from pipeline.model.minigpt import MiniGPT

CFG = dict(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=97)


def small_model(bias: bool = True, gelu: str = "tanh") -> MiniGPT:
    # init_std 0.2 gives logits of O(1), so the comparison below is not between near-zero numbers.
    m = MiniGPT(
        DataSpec(vocab_size=97), n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.0, attn_dropout=None,
        init_std=0.2, bias=bias, gelu=gelu, dtype="float32", rng=np.random.default_rng(0),
    )  # fmt: skip
    r = np.random.default_rng(5)
    for name, p in m.params.items():  # LayerNorm gains and biases away from GPT-2's 1 and 0
        if "ln_" in name or name.endswith("bias"):
            p += (0.1 * r.standard_normal(p.shape)).astype(p.dtype)
    return m


def test_written_files_round_trip(tmp_path):
    m = small_model()
    sd = m.state_dict()
    # A non-contiguous array of the right shape must still be stored by value, not by raw buffer.
    sd["transformer.h.0.mlp.c_fc.weight"] = np.asfortranarray(sd["transformer.h.0.mlp.c_fc.weight"])
    write_hf(sd, out_dir=tmp_path, **CFG)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert set(stored) == set(m.params)  # the tied head is not stored: HF ties it on load
    for name, p in m.params.items():
        assert stored[name].dtype == np.float32
        np.testing.assert_array_equal(stored[name], p, err_msg=name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
    assert (
        cfg["layer_norm_epsilon"] == 1e-5
        and cfg["n_inner"] is None
        and cfg["tie_word_embeddings"] is True
    )
    assert cfg["resid_pdrop"] == cfg["embd_pdrop"] == cfg["attn_pdrop"] == 0.0
    assert {k: cfg[k] for k in CFG} == CFG


def test_rejects_mismatched_weights(tmp_path):
    sd = small_model().state_dict()
    with pytest.raises(
        ValueError, match=r"transformer.wpe.weight: shape \(16, 32\), expected \(8, 32\)"
    ):
        write_hf(sd, out_dir=tmp_path, **{**CFG, "n_positions": 8})
    with pytest.raises(
        KeyError, match=r"parameter names differ from GPT-2's: \['transformer.ln_f.bias'"
    ):
        write_hf({k: v for k, v in sd.items() if "ln_f" not in k}, out_dir=tmp_path, **CFG)
    with pytest.raises(ValueError, match=r"lm_head.weight differs from transformer.wte.weight"):
        write_hf({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, out_dir=tmp_path, **CFG)


def test_a_bias_free_model_exports_with_zero_biases_and_computes_the_same(tmp_path):
    free = small_model(bias=False, gelu="erf")
    write_hf(free.state_dict(), out_dir=tmp_path, **CFG, bias=False, gelu="erf")
    stored = load_file(str(tmp_path / "model.safetensors"))
    biases = {k for k in stored if k.endswith(".bias")}
    assert len(biases) == 2 * 6 + 1 and all(not stored[k].any() for k in biases)
    assert json.loads((tmp_path / "config.json").read_text())["activation_function"] == "gelu"
    full = small_model(
        bias=True, gelu="erf"
    )  # GPT-2's layout with every bias, loaded from the export
    for name, p in full.params.items():
        np.copyto(p, stored[name])
    x = np.random.default_rng(1).integers(0, 97, (3, 16))
    np.testing.assert_array_equal(full.logits(x), free.logits(x))
    with pytest.raises(KeyError, match=r"a bias-free model holds transformer.h.0.attn.c_attn.bias"):
        write_hf(small_model().state_dict(), out_dir=tmp_path, **CFG, bias=False)


def test_cli_refuses_a_missing_checkpoint(tmp_path):
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


# Optional extras: skip only when a package is not installed, never on an ImportError of an installed one.
NEEDS_TOKENIZERS = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="tokenizers is not installed (pip install 'pipeline[hf]')",
)
NEEDS_HF = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="transformers and torch are not installed (pip install 'pipeline[hf,bench]')",
)


@NEEDS_HF
@pytest.mark.parametrize(("bias", "gelu"), [(True, "tanh"), (False, "erf")])
def test_transformers_loads_it_and_agrees(tmp_path, bias, gelu):
    import torch
    import transformers

    m = small_model(bias, gelu)
    write_hf(m.state_dict(), out_dir=tmp_path, **CFG, bias=bias, gelu=gelu)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), output_loading_info=True)
    # Only the causal-mask buffer (attn.bias / masked_bias in older versions) may be reported missing.
    assert all(k.endswith(("attn.bias", "attn.masked_bias")) for k in info["missing_keys"]), info
    assert not info["unexpected_keys"] and not info["mismatched_keys"] and not info["error_msgs"], (
        info
    )
    hf.eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied on load
    x = np.random.default_rng(1).integers(0, 97, (3, 16))
    with torch.no_grad():
        ref = hf(torch.from_numpy(x)).logits.numpy()
    ours = m.logits(x)
    assert ours.shape == ref.shape == (3, 16, 97)
    assert np.abs(ours).max() > 0.1  # a real comparison, not of near-zero logits
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


# --- the tokenizer, from a trained checkpoint's corpus


def exported(tmp_path: Path, *overrides: str, out: Path | None = None) -> tuple[Path, Path]:
    """(the final checkpoint of a tiny run, the directory export_hf wrote from it); the run trained into
    tmp_path/out unless it is given (`out`, a finished output directory)."""
    from conftest import run_job, the_run

    from pipeline.run.directory import RunDir

    if out is None:
        out = tmp_path / "out"
        assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
    ckpt = RunDir(the_run(out)).store.root / "final"
    main([str(ckpt), str(tmp_path / "hf")])
    return ckpt, tmp_path / "hf"


@pytest.fixture(scope="module")
def grammar_export(tmp_path_factory, finished_job):
    from conftest import TINY

    return exported(tmp_path_factory.mktemp("grammar"), out=finished_job(*TINY))


@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    from conftest import text_overrides

    tmp = tmp_path_factory.mktemp("text")
    (tmp / "a.txt").write_text("Abc dé,\nfg hé.\n" * 60)
    return exported(tmp, *text_overrides(tmp / "a.txt"))


@NEEDS_TOKENIZERS
def test_files_are_written_like_checkpoints_and_config_names_the_eos(grammar_export, text_export):
    umask = os.umask(0)
    os.umask(umask)
    for _, hf in (grammar_export, text_export):
        names = sorted(p.name for p in hf.iterdir())
        assert names == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        for p in hf.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644 & ~umask, p
    from pipeline.data.grammar import vocabulary

    eos = vocabulary().index("<eos>")
    cfg = json.loads((grammar_export[1] / "config.json").read_text())
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == cfg["pad_token_id"] == eos
    cfg = json.loads((text_export[1] / "config.json").read_text())
    assert (
        cfg["eos_token_id"] is cfg["bos_token_id"] is cfg["pad_token_id"] is None
    )  # characters have no <eos>


def corpus_of(ckpt: Path):
    from pipeline.run.trained import checkpoint_data

    return checkpoint_data(json.loads((ckpt / "manifest.json").read_text()), [], ckpt, own=True)


def in_transformers(script: str, **args) -> dict:
    """Run `script` (which reads ARGS and sets OUT) in a fresh interpreter: torch and transformers stay out of
    the test process, whose size later tests measure their children against."""
    import subprocess
    import sys

    code = f"import json, sys\nARGS = json.loads(sys.argv[1])\n{script}\nprint(json.dumps(OUT))"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def val_text(ckpt: Path):
    """(the corpus, 300 of its validation ids, their text): real corpus text, <eos>, commas, newlines, accents."""
    corpus = corpus_of(ckpt)
    ids = corpus.tokens["val"][:300]
    return corpus, ids, corpus.decode(ids)


@pytest.fixture(scope="module")
def transformers_answers(grammar_export, text_export) -> dict:
    """What transformers makes of both exports, asked in one fresh interpreter (torch and transformers are
    imported once for the module): each tokenizer on its corpus's text, and generation from the grammar model."""
    exports = {"grammar": grammar_export, "text": text_export}
    args = {
        which: {"dir": str(hf), "text": val_text(ckpt)[2], "ids": val_text(ckpt)[1].tolist()}
        for which, (ckpt, hf) in exports.items()
    }
    return in_transformers(
        """
import transformers
OUT = {}
for which, a in ARGS.items():
    tok = transformers.AutoTokenizer.from_pretrained(a["dir"])
    OUT[which] = {"vocab": tok.get_vocab(), "ids": tok(a["text"])["input_ids"], "text": tok.decode(a["ids"]),
                  "eos": [tok.eos_token, tok.eos_token_id]}
import torch
generator = transformers.pipeline("text-generation", model=ARGS["grammar"]["dir"])
(out,) = generator("the man", max_new_tokens=5, min_new_tokens=5, do_sample=True)
# greedy, token by token, through the exported tokenizer and model
tok = transformers.AutoTokenizer.from_pretrained(ARGS["grammar"]["dir"])
model = transformers.AutoModelForCausalLM.from_pretrained(ARGS["grammar"]["dir"]).eval()
ids = tok("the man", return_tensors="pt")["input_ids"]
with torch.no_grad():
    for _ in range(8):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
OUT["generation"] = {"generated": out["generated_text"], "greedy": tok.decode(ids[0])}
""",
        **args,
    )


@NEEDS_HF
@pytest.mark.parametrize("which", ["grammar", "text"])
def test_auto_tokenizer_maps_the_corpus_vocabulary_id_for_id(
    grammar_export, text_export, transformers_answers, which
):
    ckpt, _hf = grammar_export if which == "grammar" else text_export
    corpus, ids, text = val_text(ckpt)
    got = transformers_answers[which]
    assert got["vocab"] == {t: i for i, t in enumerate(corpus.vocab)}
    assert got["ids"] == ids.tolist()
    # words carry the space before them, as GPT-2's do; characters are the text itself
    assert got["text"] == (" " + text if which == "grammar" else text)
    if which == "grammar":
        assert got["eos"] == ["<eos>", corpus.vocab.index("<eos>")]


@NEEDS_HF
def test_transformers_generates_from_the_export_as_our_greedy_sampler_does(
    grammar_export, transformers_answers
):
    from pipeline.cli.sample import sample

    ckpt, _hf = grammar_export
    got = transformers_answers["generation"]
    words = got["generated"].split(" ")  # prompt + " w1 w2 ...": one space between every two words
    assert (
        words[:2] == ["the", "man"] and len(words) == 7 and set(words) <= set(corpus_of(ckpt).vocab)
    )
    assert got["greedy"] == " " + sample(
        ckpt, ["prompt=the man", "temperature=0", "max_new_tokens=8"]
    )


@NEEDS_TOKENIZERS
def test_a_moved_text_file_is_not_needed_but_by_a_schema_2_0_checkpoint(
    text_export, tmp_path, capsys
):
    """The vocabulary is the checkpoint's data.json; a checkpoint written before it (schema 2.0) builds its
    data instead, finding a moved text file by data.path or refused in one line."""
    import hashlib
    import shutil

    from pipeline.checkpoint.directory import DATA, CheckpointDir

    ckpt, hf = text_export
    # its corpus cache: tmp_path/data
    old = tmp_path / "runs" / "r" / "checkpoints" / CheckpointDir(ckpt).resolved().name
    shutil.copytree(CheckpointDir(ckpt).resolved(), old)
    (old / DATA).unlink()
    m = json.loads((old / "manifest.json").read_text())
    del m["files"][DATA]
    (old / "manifest.json").write_text(json.dumps({**m, "schema_version": "2.0"}))
    moved = tmp_path / "moved.txt"
    source = Path(m["config"]["data"]["path"])
    moved.write_bytes(source.read_bytes())
    source.rename(tmp_path / "gone.txt")
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hf.iterdir()}
    try:
        main([str(ckpt), str(tmp_path / "new")])
        assert {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "new").iterdir()
        } == digest
        capsys.readouterr()
        assert main([str(old), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "text file not found" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "hf").exists()
        main([str(old), str(tmp_path / "hf"), f"data.path={moved}"])
        assert {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "hf").iterdir()
        } == digest
    finally:
        (tmp_path / "gone.txt").rename(source)


def test_a_model_not_of_gpt2_shape_is_refused_whatever_its_class_is_called(tmp_path, capsys):
    """export_hf asks the model's config and weights for GPT-2's shape, not its class's name: an MLP is refused."""
    from conftest import KERNODECK, run_job, the_run

    out = tmp_path / "out"
    assert run_job(*KERNODECK, "trainer.max_steps=2", f"paths.output_dir={out}")[0] == 0
    final = the_run(out) / "checkpoints" / "final"
    assert main([str(final), str(tmp_path / "hf")]) == 2
    assert "holds a pipeline.model.mlp.MLP, not a MiniGPT" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
