"""Run identity: the semantic config (what changes the math), its hash, the run's name, and drift between two."""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline.config.errors import ConfigError
from pipeline.config.schemas import as_written_before, config_written_now
from pipeline.files import jsonio, names, reading

# Dotted prefixes of keys that do not change the math (where outputs go, how a run is shown, tracked, resumed)
NON_SEMANTIC = tuple(
    """paths tracking trainer.log_every trainer.progress_bar trainer.threads trainer.max_time
    trainer.profile trainer.on_nonfinite resume stages checkpoint verify optimized_metric hydra
    data.max_bytes""".split()  # noqa: SIM905
)
# Dotted prefixes of keys saying where and how a run ran on this machine, not what it computes: not params
MACHINE_KEYS = tuple(
    """paths tracking verify resume stages.resume hydra trainer.progress_bar trainer.threads
    trainer.max_time data.path data.max_bytes""".split()  # noqa: SIM905
)


def is_machine_key(key: str) -> bool:
    return covered(key, list(MACHINE_KEYS))


SOURCES = {"data.path": "data.max_bytes"}  # file -> its size bound (its identity: its content)
FIXED_BY_STATE = {  # keys a resumed run cannot apply: the restored state fixes what they choose
    "trainer.seed": "the RNG streams, the initial weights and the data order come from the checkpoint",
    "trainer.dtype": "the weights and moments are restored in the checkpoint's dtype",
    "model.init_std": "the weights come from the checkpoint, not from a new initialisation",
}
_ABSENT = object()


def config_hash(config: dict) -> str:
    return jsonio.digest(config)


def get(tree: dict, dotted: str, default=None):
    node = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def _parent(tree: dict, dotted: str) -> tuple[dict, str]:
    """(the dict holding `dotted`'s leaf, or a new empty one; the leaf's name)."""
    *parents, leaf = dotted.split(".")
    node = get(tree, ".".join(parents)) if parents else tree
    return (node if isinstance(node, dict) else {}), leaf


def source_hashes(config: dict) -> dict[str, str]:
    """sha256 of every SOURCES file the config names (a link followed); OSError for one that cannot be read."""
    out = {}
    for key, bound in SOURCES.items():
        if isinstance(p := get(config, key), str):
            if not isinstance(limit := get(config, bound), int):
                why = f"names a file but {bound} (the bound of its size) is not set: add {bound}=BYTES"
                raise ConfigError(f"{key}={p}: {why}")
            out[key] = reading.sha256(Path(p).expanduser(), limit, follow=True, bound=bound)
    return out


def semantic_config(config: dict, sources: dict[str, str]) -> dict:
    """What drift compares: the config as written now less NON_SEMANTIC keys, SOURCES keys as {"sha256": ...}."""
    out = copy.deepcopy(config_written_now(config))
    for key in NON_SEMANTIC:
        node, leaf = _parent(out, key)
        node.pop(leaf, None)
    for key, sha in sources.items():
        node, leaf = _parent(out, key)
        if leaf in node:
            node[leaf] = {"sha256": sha}
    return out


def semantic_hash(config: dict, sources: dict[str, str]) -> str:
    """The semantic config's hash, as_written_before: a key added later at the old behaviour renames no run."""
    return config_hash(as_written_before(semantic_config(config, sources)))


def lineage_of(semantic_hash: str, origin: dict | None) -> dict:
    """A run history's identity: its config and where it started (None: from scratch; else a checkpoint)."""
    ident = config_hash({"semantic_config_hash": semantic_hash, "origin": origin})
    return {"id": ident, "origin": origin}


def run_name(config: dict, sources=None, lineage=None, semantic: str | None = None) -> str:
    """<name>-<12 hex of the semantic hash>, a fork's (`lineage` with an origin) of its history's id; or BadName."""
    if lineage is not None and lineage.get("origin") is not None:
        semantic = lineage["id"]
    elif not semantic:
        semantic = semantic_hash(config, source_hashes(config) if sources is None else sources)
    return f"{names.checked(config.get('name'), 'name')}-{semantic[:12]}"


@dataclass(frozen=True)
class Identity:
    """A job's identity, computed once: what its manifests carry of its config, and its run directory's name."""

    sources: dict[str, str]  # SOURCES keys -> sha256 of the file's bytes
    config_hash: str
    semantic_hash: str
    name: str  # run_name; with resume.source=never a fresh, unique sibling of it
    lineage: dict  # the history it starts: lineage_of(semantic_hash, the fork's origin or None)


def identify(config: dict, origin: dict | None = None) -> Identity:
    """A validated config's identity (`origin`: the checkpoint a fork continues); ConfigError for an unread file."""
    try:
        sources = source_hashes(config)
    except OSError as e:
        key = next(k for k in SOURCES if get(config, k) is not None)
        raise ConfigError(f"{key}={get(config, key)}: {e.strerror or e}") from None
    lineage = lineage_of(semantic := semantic_hash(config, sources), origin)
    name = run_name(config, sources, lineage, semantic)
    if config["resume"]["source"] == "never":  # a fresh, unique sibling
        name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return Identity(sources, config_hash(config), semantic, name, lineage)


def experiment_name(name: str, model_target: str = "", data_target: str = "") -> str:
    """The mlflow experiment: `name`, or for `default` (mlflow's `Default`'s twin) `grammar-minigpt` (data-model)."""
    if name != "default":
        return name
    parts = [str(t).rsplit(".", 2)[-2] for t in (data_target, model_target) if "." in str(t)]
    return "-".join(parts) or name


def changed_keys(old: dict, new: dict) -> dict[str, tuple]:
    """Dotted key -> (old, new) for every leaf that differs; a missing side is reported as '<absent>'."""
    a, b = jsonio.flatten(old), jsonio.flatten(new)
    pairs = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))}
    return {k: (x, y) for k, (x, y) in pairs.items() if jsonio.digest(x) != jsonio.digest(y)}


def described(old: dict, new: dict, keys=None) -> list[str]:
    """Each change (for which `keys` says True) in words: `key old -> new`, or a node (a stage) `added`/`removed`."""
    said: dict[str, str] = {}
    for key, (a, b) in changed_keys(old, new).items():
        if keys is not None and not keys(key):
            continue
        parts = key.split(".")
        for i in range(1, len(parts) + 1):
            node = ".".join(parts[:i])
            added = get(old, node, _ABSENT) is _ABSENT
            if added or get(new, node, _ABSENT) is _ABSENT:
                said[node] = f"{node} {'added' if added else 'removed'}"
                break
        else:
            said[key] = f"{key} {a!r} -> {b!r}"
    return list(said.values())


def covered(key: str, allowed: list[str]) -> bool:
    """True if `key` is one of `allowed` or lies under one of them (optimizer covers optimizer.lr)."""
    return any(key == a or key.startswith(a + ".") for a in allowed)


def not_applicable(key: str) -> str | None:
    """Why an allowed change of `key` could not take effect on restored state, or None if it can."""
    return next((why for fixed, why in FIXED_BY_STATE.items() if covered(key, [fixed])), None)
