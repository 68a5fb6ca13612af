"""A checkpoint put to use (show, evaluate, sample, export): verified, restored, given data; one-line refusals."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline.checkpoint.directory import CheckpointDir, weights_bytes
from pipeline.checkpoint.errors import CheckpointError
from pipeline.config import identity, targets
from pipeline.config.compose import compose, default_output_dir, to_plain
from pipeline.config.errors import ConfigError, error_line
from pipeline.config.schemas import SCHEMAS, as_written_now, config_written_now, validate
from pipeline.data.base import DataSpec, inference_facts
from pipeline.run.directory import RunDir
from pipeline.run.plan import written_now
from pipeline.stateful import restore
from pipeline.trainer.state import TrainState

log = logging.getLogger("pipeline")
# What a data override may name: the data itself, where its cache lives, and where configs are found.
DATA_KEYS = ("data", "paths.output_dir", "hydra.searchpath")
SLACK_BYTES = 64 << 20  # twice its weights file plus this much: a model bigger is refused unbuilt


class UnknownTargetError(CheckpointError):
    """A checkpoint whose config names a `_target_` neither the pipeline's configs nor the user's name."""


def restore_checkpoint(directory: Path, overrides: Sequence[str] = ()) -> tuple[dict, TrainState]:
    """(manifest, restored state) of a checkpoint that verifies: every `_target_` allowed before anything is imported
    (UnknownTargetError), then every file against the parts built; `overrides` may give `hydra.searchpath`."""
    from pipeline.run.assemble import build_state

    checkpoint = CheckpointDir(directory)
    manifest = checkpoint.manifest()  # bounded, its hashes agree with its config: nothing built yet
    recorded = written_now(manifest["config"])  # stages.resume and stages.train as named now
    try:
        targets.check(recorded, targets.allowed(tuple(overrides)))
    except targets.UnknownTarget as e:
        raise checkpoint.fault(str(e), UnknownTargetError) from None
    config = config_written_now(recorded)  # a key added since means what its absence meant
    try:
        validate(config)  # the ranges a run's values are held to, before anything is sized by them
    except ConfigError as e:
        raise checkpoint.fault(f"its config holds a value a run refuses: {e}") from None
    spec = dict(manifest["data_spec"])
    n_train = int(spec.pop("n_train"))
    _fits_its_weights(checkpoint, manifest, config["model"], DataSpec(**spec))
    try:
        state = build_state(config, DataSpec(**spec), n_train)
    except Exception as e:
        raise checkpoint.fault(f"its config does not build here: {_first_line(e)}") from None
    # one read of each file (sizes, sha256, layouts, each part's fit): restore cannot refuse after it
    ckpt = checkpoint.load(parts := state.parts())
    if ckpt.manifest != manifest:
        raise checkpoint.fault("changed while it was read")
    restore(parts, ckpt.state)
    return manifest, state


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _fits_its_weights(ckpt: CheckpointDir, manifest: dict, node: dict, spec: DataSpec) -> None:
    """A config whose model is far bigger than its weights file is refused before a byte is allocated for it."""
    from hydra.utils import get_class

    try:
        count = getattr(get_class(node["_target_"]), "n_params", None)
        kwargs = {k: v for k, v in node.items() if k != "_target_"}
        wanted = None if count is None else count(spec, **kwargs)
    except Exception as e:
        raise ckpt.fault(f"its config does not build here: {type(e).__name__}: {e}") from None
    itemsize = np.dtype(manifest["config"]["trainer"]["dtype"]).itemsize
    # Only a gross excess is refused here: a near miss is built (cheaply) and named precisely by CheckpointDir.load.
    if wanted is not None and wanted * itemsize > 2 * weights_bytes(manifest) + SLACK_BYTES:
        size = f"{wanted:,} parameters ({wanted * itemsize:,} bytes)"
        held = f"more than its weights file holds ({weights_bytes(manifest):,} bytes)"
        raise ckpt.fault(f"its config describes a model of {size}, {held}; it was not built")


def cache_home(directory: Path) -> str:
    """The output directory a checkpoint lies in (its corpus cache), else the default; never the manifest's."""
    run = RunDir.of_checkpoint(Path(directory).absolute())
    if run is not None and run.output_dir is not None and not in_archive(directory):
        return str(run.output_dir)
    return default_output_dir()


def in_archive(directory: Path) -> bool:
    """Whether a checkpoint lies in an archive (pipeline.cli.archive), which stays as it was checked."""
    runs = Path(directory).absolute().parent.parent.parent
    return (runs.parent / "recovery.json").exists()


def _own_source(manifest: dict, node: dict, directory: Path) -> None:
    """The checkpoint's own `data.path` is read only if it holds the bytes it was trained on (it picks no file)."""
    path, sha = node.get("path"), (manifest.get("sources") or {}).get("data.path")
    if not isinstance(path, str):
        return
    try:
        here = identity.source_hashes({"data": node})["data.path"]
    except OSError as e:
        why = "text file not found" if isinstance(e, FileNotFoundError) else e.strerror or e
        said = f"{why}; give the file it was trained on with data.path=FILE"
        raise ConfigError(f"data.path={path} (the checkpoint's): {said}") from None
    if here != sha:
        said = f"not the file checkpoint {directory} was trained on (sha256 {here[:12]}, "
        said += f"the manifest says {str(sha)[:12]}); give it with data.path=FILE"
        raise ConfigError(f"data.path={path} (the checkpoint's): {said}")


def data_config(manifest: dict, overrides: list[str], directory: Path) -> dict:
    """{"paths", "data"}: the checkpoint's data with `data.KEY=V` applied, or `data=NAME` composed; validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parsed = targets.parse_overrides(overrides)
    for o in parsed:
        if not identity.covered(o.key_or_group, list(DATA_KEYS)) or o.is_sweep_override():
            only = "only data=NAME, data.KEY=VALUE, paths.output_dir=DIR and hydra.searchpath=[...]"
            rest = "can be given here; the rest is the checkpoint's"
            raise ConfigError(f"{o.input_line}: {only} {rest}")
    given = [str(o.value()) for o in parsed if o.key_or_group == "paths.output_dir"]
    output_dir = given[-1] if given else cache_home(directory)
    if any(o.key_or_group == "data" for o in parsed):
        from hydra.errors import HydraException

        try:
            node = to_plain(compose(list(overrides)))["data"]
        except (HydraException, OmegaConfBaseException) as e:
            raise ConfigError(f"bad override: {error_line(e)}") from None
    else:
        # the checkpoint's data node (a key it predates, or null then), typed by its schema
        node = as_written_now(copy.deepcopy(manifest["config"]["data"]))
        schema = SCHEMAS.get(str(node.get("_target_")))
        cfg = OmegaConf.merge(OmegaConf.structured(schema) if schema else {}, node)
        for o in parsed:
            if o.key_or_group.startswith("data."):
                try:
                    OmegaConf.update(cfg, o.key_or_group[len("data.") :], o.value(), merge=True)
                except OmegaConfBaseException as e:
                    raise ConfigError(f"{o.input_line}: {str(e).splitlines()[0]}") from None
        node = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        if not any(o.key_or_group == "data.path" for o in parsed):
            assert isinstance(node, dict)  # a mapping's container
            _own_source(manifest, node, directory)
    config = {"paths": {"output_dir": output_dir}, "data": node}
    validate(config)
    return config


def data_facts(manifest: dict, overrides: list[str], directory: Path) -> dict:
    """{"vocab", "decode_join", "specials"} of a verified checkpoint: its data.json, else (2.0) its data built."""
    if (facts := CheckpointDir(directory).data_facts(manifest)) is not None:
        return facts
    return inference_facts(checkpoint_data(manifest, overrides, directory, own=True))


def checkpoint_data(manifest: dict, overrides: list[str], directory: Path, own: bool = False):
    """The dataset `overrides` ask for (the checkpoint's own by default, regenerated if its corpus is gone), else
    ConfigError: `own` and not the data it was trained on, or data the model cannot read (spec, vocabulary)."""
    from pipeline.run.assemble import build_dataset

    config = data_config(manifest, list(overrides), directory)
    try:
        dataset = build_dataset(config)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data: {e}") from None
    except Exception as e:
        raise ConfigError(f"data does not build: {_first_line(e)}") from None
    if dataset.manifest_hash == manifest["data_manifest_hash"]:
        return dataset
    if own:
        said = f"builds data {dataset.manifest_hash[:12]}, but the checkpoint was trained on"
        then = "give the data it was trained on (data.path=FILE for a moved text file)"
        data, trained = config["data"].get("_target_"), manifest["data_manifest_hash"][:12]
        raise ConfigError(f"data {data}: {said} {trained}: {then}")
    vocab: list = []  # the checkpoint's, if both have one
    if (theirs := getattr(dataset, "vocab", None)) is not None:
        try:
            where = [o for o in overrides if o.startswith(("paths.", "hydra."))]
            vocab = data_facts(manifest, where, directory)["vocab"] or []  # None: it has none
        except ConfigError as e:  # a schema 2.0 checkpoint whose own data does not build here
            said = "cannot compare vocabularies (the checkpoint's own data does not build here: %s)"
            log.warning(said + "; checking the spec only", e)
    saved = {k: v for k, v in manifest["data_spec"].items() if k != "n_train"}
    here, name = asdict(dataset.spec), f"data {type(dataset).__name__}"
    if diff := [f"{k} {saved[k]} -> {here.get(k)}" for k in saved if saved[k] != here.get(k)]:
        said = f"its spec differs from the checkpoint's ({', '.join(diff)})"
        raise ConfigError(f"{name}: {said}: the model cannot read it")
    if changed := [i for i, (a, b) in enumerate(zip(vocab, theirs or ())) if a != b]:
        i, said = changed[0], "its vocabulary differs from the checkpoint's at"
        at = f"{len(changed)} ids (id {i}: {vocab[i]!r} -> {dataset.vocab[i]!r})"
        raise ConfigError(f"{name}: {said} {at}")
    return dataset
