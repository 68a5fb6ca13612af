"""A checkpoint as an mlflow pyfunc model, logged from code (never a pickle): what register and it share."""

CHECKPOINT, VOCAB = (
    "checkpoint",
    "vocab",
)  # artifact names: the checkpoint's directory, its vocabulary's JSON
DATA_JSON = "data.json"  # a checkpoint's own record of its data, when it has one
OPTIONS = (
    "prompt",
    "max_new_tokens",
    "temperature",
    "top_k",
    "seed",
)  # as pipeline.model.generate takes them
