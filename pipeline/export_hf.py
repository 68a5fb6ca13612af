"""Write MiniGPT weights as a Hugging Face GPT-2 directory (config.json + model.safetensors)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TIED = "lm_head.weight"  # the head is wte: HF ties it on load (tie_word_embeddings), so it is not stored


def expected_shapes(*, n_layer: int, n_embd: int, n_positions: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF GPT2LMHeadModel's stored weights (Conv1D layout, weight [in, out]), without the tied head."""
    d = n_embd
    shapes = {"transformer.wte.weight": (vocab_size, d), "transformer.wpe.weight": (n_positions, d)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        shapes.update(
            {
                h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
                h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                h + "mlp.c_fc.weight": (d, 4 * d), h + "mlp.c_fc.bias": (4 * d,),
                h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,),
            }
        )  # fmt: skip
    shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    return shapes


def gpt2_config(*, n_layer: int, n_head: int, n_embd: int, n_positions: int, vocab_size: int) -> dict:
    """A GPT2Config matching MiniGPT: gelu_new, LayerNorm eps 1e-5, 4x MLP, tied head, no dropout."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": n_positions,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        # GPT2Config defaults these to 50256, which is outside a small vocabulary; our data defines none.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def write_hf(
    params: dict[str, np.ndarray],
    *,
    n_layer: int,
    n_head: int,
    n_embd: int,
    n_positions: int,
    vocab_size: int,
    out_dir,
) -> Path:
    """Check names and shapes, then write config.json and model.safetensors (float32) into out_dir."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
    shapes = expected_shapes(n_layer=n_layer, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab_size)
    given = set(params) - {TIED}
    if given != set(shapes):
        raise KeyError(f"parameter names differ from GPT-2's: {sorted(given ^ set(shapes))}")
    if TIED in params and not np.array_equal(params[TIED], params["transformer.wte.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight; GPT-2 here ties them")
    tensors = {}
    for name, shape in shapes.items():
        a = np.asarray(params[name])
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape}, expected {shape}")
        # Contiguous and owned: safetensors writes the raw buffer, so a strided view would be stored wrong.
        tensors[name] = np.ascontiguousarray(a, dtype=np.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a MiniGPT checkpoint as a Hugging Face GPT-2 directory.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    args = parser.parse_args(argv)
    from pipeline.checkpoint import CheckpointError
    from pipeline.checkpoint.store import load, read_manifest
    from pipeline.job import parts_for

    try:
        ckpt = load(Path(args.checkpoint), parts_for(read_manifest(Path(args.checkpoint))))  # fully verified
    except CheckpointError as e:
        raise SystemExit(f"pipeline.export_hf: {e}")
    model = ckpt.manifest["config"]["model"]
    if not str(model.get("_target_", "")).endswith("MiniGPT"):
        raise SystemExit(f"pipeline.export_hf: {args.checkpoint} holds a {model.get('_target_')}, not a MiniGPT")
    weights = ckpt.state["model"]
    out = write_hf(weights, n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                   n_positions=weights["transformer.wpe.weight"].shape[0],
                   vocab_size=weights["transformer.wte.weight"].shape[0], out_dir=args.out_dir)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")


if __name__ == "__main__":
    main()
