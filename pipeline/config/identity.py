"""Run identity: the semantic config (what changes the math), its hash, the run's name, and drift between two.

The run directory is `<runs_dir>/<name>-<12 hex>`, the hex being the sha256 of the canonical JSON of the
semantic config: the resolved config minus NON_SEMANTIC keys, with every SOURCES key (a file the run reads)
replaced by the sha256 of the file's bytes. So the same job lands in the same directory whatever the output
directory, the working directory, or how the file's path was typed; and two different files given by the
same relative path are two runs.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

from pipeline.files import jsonio
from pipeline.files import reading
from pipeline.config.schemas import TEXT_MAX_BYTES

# Keys that do not change the math: where outputs go, how progress is shown and logged, how the run is
# indexed, resumed and parallelised, how big an input file may be, and the verifier's own settings. Dotted
# prefixes.
NON_SEMANTIC = (
    "paths",
    "tracking",
    "trainer.log_every",
    "trainer.progress_bar",
    "trainer.threads",
    "trainer.max_time",
    "trainer.on_nonfinite",
    "resume",
    "stages",
    "checkpoint",
    "verify",
    "optimized_metric",
    "hydra",
    "data.max_bytes",
)
# Keys naming an input file: identity is the file's content, not the path string. Each maps to the key
# bounding the file's size, and the bound when that is null (a config from before the key existed): a
# bigger file is refused unread.
SOURCES = {"data.path": ("data.max_bytes", TEXT_MAX_BYTES)}
# Keys a resumed run cannot apply: what they choose is fixed by the restored state itself.
FIXED_BY_STATE = {
    "trainer.seed": "the RNG streams, the initial weights and the data order come from the checkpoint",
    "trainer.dtype": "the weights and moments are restored in the checkpoint's dtype",
    "model.init_std": "the weights come from the checkpoint, not from a new initialisation",
}


def canonical_json(obj) -> bytes:
    """The bytes every hash in this project is taken over: sorted keys, no spaces, UTF-8, standard JSON."""
    return jsonio.dumps(obj, canonical=True)


def config_hash(config: dict) -> str:
    return hashlib.sha256(canonical_json(config)).hexdigest()


def get(tree: dict, dotted: str, default=None):
    node = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def _drop(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = get(tree, ".".join(parents)) if parents else tree
    if isinstance(node, dict):
        node.pop(leaf, None)


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = get(tree, ".".join(parents)) if parents else tree
    if isinstance(node, dict) and leaf in node:
        node[leaf] = value


def source_hashes(config: dict) -> dict[str, str]:
    """sha256 of every SOURCES file the config names, streamed (constant memory); OSError if one cannot be
    read: reading.UnreadableFile, before it is opened, for a FIFO, a device, ... or a file over its bound.
    A symlink is followed to its target (a user's data file may be a link to it)."""
    out = {}
    for key, (bound, default) in SOURCES.items():
        if isinstance(p := get(config, key), str):
            limit = get(config, bound)
            out[key] = reading.sha256(Path(p).expanduser(), default if limit is None else limit, follow=True,
                                      bound=bound)
    return out


def semantic_config(config: dict, sources: dict[str, str] | None = None) -> dict:
    """The config minus NON_SEMANTIC keys, SOURCES keys replaced by {"sha256": ...} of the file's bytes
    (`sources` gives them, e.g. as a manifest recorded them; None reads the files)."""
    sources = source_hashes(config) if sources is None else sources
    out = copy.deepcopy(config)
    for key in NON_SEMANTIC:
        _drop(out, key)
    for key, sha in sources.items():
        _set(out, key, {"sha256": sha})
    return out


def semantic_hash(config: dict, sources: dict[str, str] | None = None) -> str:
    return config_hash(semantic_config(config, sources))


def run_name(config: dict, sources: dict[str, str] | None = None, semantic: str | None = None) -> str:
    """<experiment name>-<12 hex of the semantic config's sha256>: the stable run directory name (`semantic`:
    that hash, if the caller has it already)."""
    return f"{config.get('name', 'run')}-{(semantic or semantic_hash(config, sources))[:12]}"


def changed_keys(old: dict, new: dict) -> dict[str, tuple]:
    """Dotted key -> (old, new) for every leaf that differs; a missing side is reported as '<absent>'."""
    a, b = jsonio.flatten(old), jsonio.flatten(new)
    absent = "<absent>"
    return {k: (a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b))
            if canonical_json(a.get(k, absent)) != canonical_json(b.get(k, absent))}


def covered(key: str, allowed: list[str]) -> bool:
    """True if `key` is one of `allowed` or lies under one of them (optimizer covers optimizer.lr)."""
    return any(key == a or key.startswith(a + ".") for a in allowed)


def not_applicable(key: str) -> str | None:
    """Why an allowed change of `key` could not take effect on restored state, or None if it can."""
    for fixed, why in FIXED_BY_STATE.items():
        if key == fixed or key.startswith(fixed + "."):
            return why
    return None
