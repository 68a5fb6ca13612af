"""export_hf: the written directory round-trips, and (with torch + transformers) loads as GPT2LMHeadModel."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from pipeline.data.base import DataSpec
from pipeline.export_hf import main, write_hf

from pipeline.model.minigpt import MiniGPT

CFG = dict(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=97)


def small_model() -> MiniGPT:
    # init_std 0.2 gives logits of O(1), so the comparison below is not between near-zero numbers.
    return MiniGPT(
        DataSpec(vocab_size=97), n_layer=2, n_head=4, n_embd=32, block_size=16, init_std=0.2,
        rng=np.random.default_rng(0),
    )  # fmt: skip


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
    assert cfg["layer_norm_epsilon"] == 1e-5 and cfg["n_inner"] is None and cfg["tie_word_embeddings"] is True
    assert cfg["resid_pdrop"] == cfg["embd_pdrop"] == cfg["attn_pdrop"] == 0.0
    assert {k: cfg[k] for k in CFG} == CFG


def test_rejects_mismatched_weights(tmp_path):
    sd = small_model().state_dict()
    with pytest.raises(ValueError):
        write_hf(sd, out_dir=tmp_path, **{**CFG, "n_positions": 8})
    with pytest.raises(KeyError):
        write_hf({k: v for k, v in sd.items() if "ln_f" not in k}, out_dir=tmp_path, **CFG)
    with pytest.raises(ValueError):
        write_hf({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, out_dir=tmp_path, **CFG)


def test_cli_refuses_a_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_transformers_loads_it_and_agrees(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = small_model()
    write_hf(m.state_dict(), out_dir=tmp_path, **CFG)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), output_loading_info=True)
    # Only the causal-mask buffer (attn.bias / masked_bias in older versions) may be reported missing.
    assert all(k.endswith(("attn.bias", "attn.masked_bias")) for k in info["missing_keys"]), info
    assert not info["unexpected_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    hf.eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied on load
    x = np.random.default_rng(1).integers(0, 97, (3, 16))
    with torch.no_grad():
        ref = hf(torch.from_numpy(x)).logits.numpy()
    ours = m.logits(x)
    assert ours.shape == ref.shape == (3, 16, 97)
    assert np.abs(ours).max() > 0.1  # a real comparison, not of near-zero logits
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
