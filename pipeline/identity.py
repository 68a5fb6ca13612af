"""Run identity: the semantic config (what changes the math), its hash, and key-by-key drift between two."""
from __future__ import annotations

import copy

from pipeline.checkpoint.facts import canonical_json, config_hash

# Keys that do not change the math: where outputs go, how progress is shown and logged, how the run is
# indexed and resumed, and the verifier's own settings. Dotted prefixes.
NON_SEMANTIC = (
    "paths",
    "tracking",
    "trainer.log_every",
    "trainer.progress_bar",
    "resume",
    "stages",
    "checkpoint",
    "verify",
    "hydra",
)


def _drop(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(leaf, None)


def semantic_config(config: dict) -> dict:
    out = copy.deepcopy(config)
    for key in NON_SEMANTIC:
        _drop(out, key)
    return out


def semantic_hash(config: dict) -> str:
    return config_hash(semantic_config(config))


def run_id(config: dict) -> str:
    """<experiment name>-<12 hex of the semantic config's sha256>: the stable run directory name."""
    return f"{config.get('name', 'run')}-{semantic_hash(config)[:12]}"


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def changed_keys(old: dict, new: dict) -> dict[str, tuple]:
    """Dotted key -> (old, new) for every leaf that differs; a missing side is reported as '<absent>'."""
    a, b = flatten(old), flatten(new)
    absent = "<absent>"
    return {k: (a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b))
            if canonical_json(a.get(k, absent)) != canonical_json(b.get(k, absent))}
