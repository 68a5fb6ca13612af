"""The pyfunc model over a checkpoint: MiniGPT rows of prompts -> their continuations, an MLP's rows -> outputs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pydantic
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from pipeline.files.limits import MAX_VOCAB_JSON
from pipeline.serving import CHECKPOINT, DATA_JSON, OPTIONS, VOCAB, generates


def read_vocab(checkpoint: Path, vocab_json: str | None) -> tuple[list[str], str, str | None]:
    """(vocab, decode_join, eos): the checkpoint's data.json (verified), else (schema 2.0) the vocab.json beside it."""
    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.files import jsonio

    if (facts := CheckpointDir(checkpoint).data_facts()) is not None:
        return facts["vocab"], facts["decode_join"], (facts.get("specials") or {}).get("eos")
    if vocab_json is None:
        why = f"a MiniGPT needs its vocabulary (no {DATA_JSON}, no vocab.json)"
        raise MlflowException(f"{checkpoint}: {why}")
    record = jsonio.read(vocab_json, MAX_VOCAB_JSON)
    record = record if isinstance(record, dict) else {}
    vocab, join = record.get("vocab"), record.get("decode_join")
    if not (
        isinstance(vocab, list) and isinstance(join, str) and all(type(t) is str for t in vocab)
    ):
        why = "needs a list of strings `vocab` and a string `decode_join`"
        raise MlflowException(f"{vocab_json}: {why}")
    return vocab, join, ("<eos>" if "<eos>" in vocab else None)


def unknown_columns(unknown: list) -> str:
    return f"unknown column(s) {unknown}: a row gives {', '.join(OPTIONS)}"


def _args(row: dict) -> list[str]:
    """A row as parse_options's key=value arguments; a missing value (None, NaN) takes the default."""
    if unknown := sorted(set(row) - set(OPTIONS)):
        raise MlflowException(unknown_columns(unknown), error_code=INVALID_PARAMETER_VALUE)
    args = []
    for key in OPTIONS:
        value = row.get(key)
        value = value.item() if isinstance(value, np.generic) else value
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if isinstance(value, float) and key != "temperature" and value.is_integer():
            value = int(value)  # a column with a missing value arrives as floats
        args.append(f"{key}={value}")
    return args


class CheckpointModel(PythonModel):
    """Artifacts: `checkpoint/` (fully verified on load) and, for a MiniGPT without data.json, register's vocab.json."""

    def load_context(self, context) -> None:
        from pipeline.run.trained import restore_checkpoint

        self.directory = Path(context.artifacts[CHECKPOINT])
        _, state = restore_checkpoint(self.directory)
        self.model: Any = state.model  # a MiniGPT (logits) or a regression model (predict)
        if generates(self.model):
            vocab_json = context.artifacts.get(VOCAB)
            self.vocab, self.join, self.eos = read_vocab(self.directory, vocab_json)

    # The hint only tells mlflow not to infer a schema from it (the signature is logged); an MLP's rows arrive
    # as an ndarray [B, n_features].
    def predict(self, context, model_input: pd.DataFrame, params=None):
        if not generates(self.model):  # rows [B, n_features] -> [B, n_targets]
            dtype = getattr(self.model, "dtype", np.float64)
            return self.model.predict(np.asarray(model_input, dtype=dtype))
        from pipeline.config.errors import ConfigError
        from pipeline.model.generate import continuation, parse_options

        if isinstance(model_input, pd.DataFrame):
            model_input = model_input.to_dict(orient="records")
        out = []
        for row in [model_input] if isinstance(model_input, dict) else model_input:
            try:
                options, _ = parse_options(_args(dict(row)))
                out.append(continuation(self.model, self.vocab, self.join, options, self.eos))
            except ConfigError as e:
                raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        return out


class Row(pydantic.BaseModel):
    """A MiniGPT row: `prompt` and sample's options only; mlflow refuses another column before predict."""

    model_config = pydantic.ConfigDict(extra="forbid")
    prompt: str
    max_new_tokens: Any = None  # checked as pipeline.model.generate checks them (_args)
    temperature: Any = None
    top_k: Any = None
    seed: Any = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _only_options(cls, row):
        if isinstance(row, dict) and (unknown := sorted(set(row) - set(OPTIONS), key=str)):
            raise ValueError(unknown_columns(unknown))
        return row


class GeneratorModel(CheckpointModel):
    """A MiniGPT checkpoint: rows of prompts (Row) -> their continuations."""

    def predict(self, context, model_input: list[Row], params=None) -> list[str]:
        return super().predict(context, [row.model_dump() for row in model_input], params)
