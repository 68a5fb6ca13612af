"""`python -m pipeline.register CHECKPOINT NAME [--tracking-uri URI]`: the checkpoint as an mlflow model, registered.

Logged from code, never a pickle; prints `models:/NAME/VERSION`; its exit codes: docs/serving.md."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from pipeline.cli import parser
from pipeline.config.errors import EXIT_ERROR, EXIT_OK, CommandError, ConfigError
from pipeline.run.signals import command, run_command

NAME = "pipeline.register"
SERVING = Path(__file__).resolve().parents[1] / "serving"
# The code mlflow logs: an MLP's rows of features (its signature), a MiniGPT's rows typed by predict (Row).
CODE, GENERATOR_CODE = SERVING / "pyfunc_model.py", SERVING / "generator_pyfunc_model.py"
ARTIFACT_PATH = "model"  # the model's name inside its run
INTERRUPTED = "a run or a model version may be partly logged; register again for a new one"


def signature_of(manifest: dict, model, prompt: str = ""):
    """(signature, input example): a MiniGPT's None (mlflow checks rows against Row), an MLP's tensors."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    if hasattr(model, "logits"):
        return None, [{"prompt": prompt, "max_new_tokens": 4, "seed": 0}]
    spec = manifest["data_spec"]
    dtype: Any = getattr(model, "dtype", "float64")  # numpy's, or a name: TensorSpec takes both
    shapes = [(-1, spec[k]) for k in ("n_features", "n_targets")]
    inputs, outputs = (Schema([TensorSpec(dtype, shape)]) for shape in shapes)
    return ModelSignature(inputs, outputs), np.zeros((1, spec["n_features"]), dtype=dtype)


def requirements() -> list[str]:
    """What the model's code imports, pinned as installed here (`pipeline` is on no index: --env-manager local)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("mlflow", "numpy", "pandas", "safetensors", "hydra-core", "omegaconf"):
        with suppress(PackageNotFoundError):
            out.append(f"{name}=={version(name)}")
    return out


@contextmanager
def using_store(uri: str):
    """mlflow's fluent API (log_model has no other) pointed at `uri` for the block, all it changed put back."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry
    from mlflow.tracking._tracking_service import utils as tracking

    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    saved: tuple[Any, Any] = tracking._tracking_uri, registry._registry_uri
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])  # the setter also resets what mlflow derived from it
        registry._registry_uri = saved[1]
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for k in [k for k, v in env.items() if v is None]:
            os.environ.pop(k, None)


def store_uri(checkpoint: Path, tracking_uri: str | None) -> str:
    """--tracking-uri, MLFLOW_TRACKING_URI, else the checkpoint's output directory's mlflow.db (never an archive's)."""
    from pipeline.run.trained import cache_home, in_archive
    from pipeline.tracking.common import default_uri, normalize_tracking_uri

    named = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not named and in_archive(checkpoint):
        how = "name the store to register it in with --tracking-uri URI (or MLFLOW_TRACKING_URI)"
        raise ConfigError(f"checkpoint {checkpoint} lies in an archive: {how}; nothing was written")
    return normalize_tracking_uri(named or default_uri(cache_home(checkpoint)))


def register(given: Path, name: str, tracking_uri: str | None = None):
    """(ModelVersion, store URI): the checkpoint logged as a pyfunc model, the next version of `name`."""
    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.files import jsonio, names
    from pipeline.run.trained import checkpoint_data, restore_checkpoint
    from pipeline.serving import CHECKPOINT, VOCAB

    if (why := names.problem(name, reserve=0)) is not None or not name.strip():
        what = "models:/NAME/VERSION and a directory of a file store"
        why = f"{why or 'must not be blank'} (a registered model's name is {what})"
        raise ConfigError(f"NAME={names.shown(name)}: {why}")
    checkpoint = CheckpointDir(given)
    directory = checkpoint.resolved()  # `final`, `best`: the step directory they stand for
    # refused here, before mlflow is imported or a byte written
    manifest, state = restore_checkpoint(directory)
    if not (hasattr(state.model, "logits") or hasattr(state.model, "predict")):
        held = f"checkpoint {directory} holds a {manifest['config']['model'].get('_target_')}"
        why = "neither generates tokens (logits) nor predicts rows (predict): nothing to serve"
        raise ConfigError(f"{held}, which {why}")
    vocab = None
    if hasattr(state.model, "logits") and checkpoint.data_facts(manifest) is None:  # schema 2.0
        dataset = checkpoint_data(manifest, [], given, own=True)
        vocab = {"vocab": list(dataset.vocab), "decode_join": dataset.manifest["decode_join"]}

    uri = store_uri(given, tracking_uri)  # an archive's, no store named: refused before mlflow
    import mlflow

    from pipeline.tracking.common import experiment_of, parse_run_uri, tag_value
    from pipeline.tracking.store import ensure_experiment, open_store

    client, _ = open_store(uri)  # a sqlite store's artifacts beside it, as a run's
    experiment_id = ensure_experiment(client, str(experiment_of(manifest["config"])), None)
    first_word = next((t for t in (vocab or {}).get("vocab", ()) if t.strip()), "")
    signature, example = signature_of(manifest, state.model, first_word)
    _, _, run_id = parse_run_uri(run_uri := manifest.get("mlflow_run_uri"))
    tags = {"checkpoint": str(directory), "step": manifest.get("step"), "training_run_id": run_id}
    tags |= {"config_hash": manifest.get("config_hash"), "training_run_uri": run_uri}
    tags = {k: tag_value(v) for k, v in tags.items() if v is not None}
    model = dict(signature=signature, input_example=example, pip_requirements=requirements())
    with tempfile.TemporaryDirectory(prefix="pipeline-register-") as tmp:
        # mlflow uploads a copy made from the verified files (one that changed since is refused here)
        checkpoint.copy_to(Path(tmp) / directory.name, manifest)
        artifacts = {CHECKPOINT: str(Path(tmp) / directory.name)}
        if vocab is not None:
            (Path(tmp) / "vocab.json").write_bytes(jsonio.dumps(vocab))
            artifacts[VOCAB] = str(Path(tmp) / "vocab.json")
        run: dict = dict(experiment_id=experiment_id, run_name=f"register {name}", tags=tags)
        with using_store(uri), mlflow.start_run(**run):  # the store first: the run starts in it
            code = str(GENERATOR_CODE if signature is None else CODE)
            model |= dict(name=ARTIFACT_PATH, python_model=code, artifacts=artifacts)
            info = mlflow.pyfunc.log_model(**model, registered_model_name=name)
    return client.get_model_version(name, str(info.registered_model_version)), uri


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    ap = parser(NAME, __doc__)
    ap.add_argument("checkpoint", help="a checkpoint directory (RUN/checkpoints/final, .../step-N)")
    ap.add_argument("name", help="the registered model's name")
    default = "MLFLOW_TRACKING_URI, else sqlite:///<OUTPUT_DIR>/mlflow.db"
    ap.add_argument("--tracking-uri", default=None, help=f"the store (default: {default})")
    args = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per file copy
    try:
        version, uri = register(Path(args.checkpoint), args.name, args.tracking_uri)
    except Exception as e:
        # mlflow's refusals come once register() imported it: never imported for an earlier refusal
        mlflow = sys.modules.get("mlflow")
        if mlflow is None or not isinstance(e, mlflow.exceptions.MlflowException):
            raise
        raise CommandError(f"mlflow: {str(e).splitlines()[0]}", exit_code=EXIT_ERROR) from e
    print(f"registered in the model registry of {uri} (logged as run {version.run_id})")
    print(f"models:/{version.name}/{version.version}")
    return EXIT_OK


if __name__ == "__main__":
    run_command(NAME, main, INTERRUPTED)
