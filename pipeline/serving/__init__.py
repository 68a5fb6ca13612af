"""A checkpoint as an mlflow pyfunc model, logged from code (never a pickle): what register and it share."""

# Artifact names: the checkpoint's directory, its vocabulary's JSON; the checkpoint's own record of its data.
CHECKPOINT, VOCAB, DATA_JSON = "checkpoint", "vocab", "data.json"
# As model/generate.py takes them
OPTIONS = ("prompt", "max_new_tokens", "temperature", "top_k", "seed")


def generates(model) -> bool:
    """A model that generates tokens (a MiniGPT: logits over a block), which sample and serving decode."""
    return hasattr(model, "logits") and hasattr(model, "block_size")
