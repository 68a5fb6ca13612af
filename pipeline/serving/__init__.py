"""A checkpoint as an mlflow pyfunc model, logged from code (never a pickle); see pipeline/cli/register.py.

What the registering side and the model share, importable without mlflow: the names of the model's artifacts
and the columns a MiniGPT row may give.
"""
CHECKPOINT, VOCAB = "checkpoint", "vocab"  # artifact names: the checkpoint's directory, its vocabulary's JSON
DATA_JSON = "data.json"  # a checkpoint's own record of its data, when it has one
OPTIONS = ("prompt", "max_new_tokens", "temperature", "top_k", "seed")  # as pipeline.cli.sample takes them
