"""MiniGPT weights as a Hugging Face GPT-2 directory (docs/serving.md), each file replaced atomically, mode 0644."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from pipeline.config.errors import CommandError
from pipeline.files.atomic import replace_file
from pipeline.run.signals import command, run_command

NAME = "pipeline.export_hf"
EOS = "<eos>"  # the grammar corpus's end of sentence: GPT-2's <|endoftext|> role (bos, eos and pad)
TIED = "lm_head.weight"  # the head is wte: HF ties it on load (tie_word_embeddings), so it is not stored

INTERRUPTED = "OUT_DIR may hold part of the export (each file whole); re-run the same command"


def gpt2_shaped(model: dict) -> bool:
    """Whether a model config has the shape written as GPT-2 here (and sampled): MiniGPT's layers, heads, width."""
    return all(type(model.get(k)) is int for k in ("n_layer", "n_head", "n_embd"))


def expected_shapes(config: dict) -> dict:
    """HF GPT2LMHeadModel's stored weights (Conv1D layout, weight [in, out]), without the tied head."""
    d = config["n_embd"]
    shapes: dict[str, tuple] = {"transformer.wte.weight": (config["vocab_size"], d)}
    shapes["transformer.wpe.weight"] = (config["n_positions"], d)
    block = {"ln_1": (d,), "attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "ln_2": (d,)}
    block |= {"mlp.c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
    modules = {f"h.{i}.{n}": w for i in range(config["n_layer"]) for n, w in block.items()}
    # each weight, then its bias: as wide as its module's output
    for name, w in {**modules, "ln_f": (d,)}.items():
        shapes |= {f"transformer.{name}.weight": w, f"transformer.{name}.bias": w[-1:]}
    return shapes


def gpt2_config(n_layer, n_head, n_embd, n_positions, vocab_size, eos_id, gelu) -> dict:
    """A GPT2Config matching MiniGPT: its GELU, LayerNorm eps 1e-5, 4x MLP, tied head, no dropout."""
    out: dict = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=vocab_size)
    out |= dict(n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    # n_inner None: 4 * n_embd
    out |= dict(n_inner=None, activation_function={"tanh": "gelu_new", "erf": "gelu"}[gelu])
    out |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
    out |= dict(initializer_range=0.02, scale_attn_weights=True)
    out |= dict(scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    out |= dict(tie_word_embeddings=True, use_cache=True)
    # GPT2Config defaults these to 50256, outside a small vocabulary: the corpus's <eos> plays all three
    # roles, as <|endoftext|> does in GPT-2; a vocabulary without one (data=text) has none.
    out |= dict(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return out | dict(torch_dtype="float32")


def tokenizer_files(vocab: list[str], join: str | None, n_positions: int, eos=EOS) -> dict:
    """tokenizer.json (WordLevel over the corpus vocabulary, same ids) and tokenizer_config.json (docs/serving.md)."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    except ModuleNotFoundError as e:
        if e.name != "tokenizers":
            raise
        from pipeline.config.compose import install_hint

        hint = install_hint("hf")
        raise ValueError(f"writing the tokenizer needs the `tokenizers` package: {hint}") from None

    if len(set(vocab)) != len(vocab):
        raise ValueError("the vocabulary repeats a token; a tokenizer needs each once")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=None))
    if join == " ":
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.Replace(Regex("^"), " ")  # a space before every word
    elif join == "":
        # [\s\S]: newlines too
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        why = f"no tokenizer for a corpus decoded with {join!r} between tokens"
        raise ValueError(f"{why} (words or characters only)")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=n_positions)
    # transformers would otherwise rewrite " ," as "," on decode: the corpus's text is the tokens joined
    config["clean_up_tokenization_spaces"] = False
    if eos is not None and eos in vocab:
        # already in the vocabulary: same id, never split, skippable on decode
        tok.add_special_tokens([eos])
        config |= dict(bos_token=eos, eos_token=eos, pad_token=eos)
    return {
        "tokenizer.json": tok.to_str(pretty=True).encode() + b"\n",
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
    }


def write_hf(
    params: dict, *, out_dir, vocab=None, join=None, eos=EOS, gelu="tanh", bias=True, **dims
) -> Path:
    """config.json, model.safetensors and given a vocabulary its tokenizer into out_dir, names and shapes checked."""
    eos_id = list(vocab).index(eos) if vocab is not None and eos in vocab else None
    config = gpt2_config(**dims, eos_id=eos_id, gelu=gelu)
    shapes = expected_shapes(config)
    if not bias:
        zeros = {k: np.zeros(s, np.float32) for k, s in shapes.items() if k.endswith(".bias")}
        if clash := sorted(set(zeros) & set(params)):
            raise KeyError(f"a bias-free model holds {clash[0]}")
        params = {**params, **zeros}
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
    files = {}
    if vocab is not None:
        if len(vocab) != (n := config["vocab_size"]):
            raise ValueError(f"the vocabulary has {len(vocab)} tokens, the model {n}")
        files.update(tokenizer_files(list(vocab), join, config["n_positions"], eos))
    files["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    files["model.safetensors"] = save(tensors, metadata={"format": "pt"})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        replace_file(out / name, data)
    return out


@command("pipeline.export_hf")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Export a MiniGPT checkpoint as a Hugging Face GPT-2 directory.",
        epilog="The vocabulary is the checkpoint's data.json; only for a checkpoint written before it "
        "(schema 2.0) is the training data built, found with data.path=FILE (a moved text file), "
        "paths.output_dir=DIR (the corpus cache)",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    hint = "data.path=FILE, paths.output_dir=DIR, hydra.searchpath=[...]"
    parser.add_argument("overrides", nargs="*", help=hint)
    args = parser.parse_args(argv)
    from pipeline.config.schemas import as_written_now
    from pipeline.run.trained import data_facts, restore_checkpoint

    try:
        manifest, state = restore_checkpoint(ck := Path(args.checkpoint), args.overrides)
        # bias and gelu: a checkpoint may predate them
        model, weights = as_written_now(manifest["config"]["model"]), state.model.state_dict()
        if not (gpt2_shaped(model) and "transformer.wte.weight" in weights):
            raise CommandError(f"{ck} holds a {model.get('_target_')}, not a MiniGPT")
        facts = data_facts(manifest, args.overrides, ck)
        if facts["vocab"] is None:
            raise CommandError(f"{ck}: its data has no vocabulary to make a tokenizer of")
        hf = {k: model[k] for k in ("n_layer", "n_head", "n_embd", "gelu", "bias")}
        wpe, wte = (weights[f"transformer.{k}.weight"].shape[0] for k in ("wpe", "wte"))
        hf |= dict(n_positions=wpe, vocab_size=wte, vocab=facts["vocab"], join=facts["decode_join"])
        out = write_hf(weights, out_dir=args.out_dir, eos=facts["specials"].get("eos"), **hf)
    except ValueError as e:  # a weight whose shape does not fit: bad input
        raise CommandError(str(e)) from e
    print(f"wrote {out}: config.json, model.safetensors, tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    run_command(NAME, main, INTERRUPTED)
