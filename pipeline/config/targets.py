"""Which `_target_`s a config read from disk may name: those in the pipeline's YAML and in your own configs."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.config.compose import CONFIG_DIR
from pipeline.config.errors import ConfigError

HINT = "give your config directory with hydra.searchpath=[...] to use your own classes"

# The node each pipeline package's classes are built under (elsewhere: refused); conf/'s own: only in its `slots()`
PLACES = {k: k for k in ("model", "data", "optimizer", "scheduler", "stages", "tracking")}
PLACES |= {"checkpoint": "stages", "hydra": "tracking"}
TOPS = ("model", "data", "optimizer", "scheduler", "tracking", "checkpoint")


def slot(keys: tuple[str, ...]) -> str:
    """The slot a node at `keys` is built in (a stage's `cadence` is a `checkpoint`); elsewhere, its dotted path."""
    if len(keys) == 1 and keys[0] in TOPS:
        return keys[0]
    if len(keys) == 2 and keys[0] == "stages":
        return "stages.<name>"
    if len(keys) == 3 and keys[0] == "stages" and keys[2] == "cadence":
        return "checkpoint"
    if len(keys) == 3 and keys[:2] == ("hydra", "callbacks"):
        return "hydra.callbacks.<name>"
    return ".".join(keys) or "the top level"


class UnknownTarget(ConfigError):
    """A `_target_` (or an interpolation, which could make one) that nothing the user runs names."""


def _nodes(tree, keys: tuple[str, ...] = ()):
    """(keys, node) for a tree of dicts and lists and every node in it, parents first (a list's item: `a[0]`)."""
    yield keys, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _nodes(v, (*keys, str(k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _nodes(v, (*keys[:-1], f"{keys[-1] if keys else ''}[{i}]"))


def _placed(tree, keys: tuple[str, ...] = (), out: dict[str, set[str]] | None = None) -> dict:
    """Every string `_target_` in a tree (interpolations left out: never allowed) -> the slots it is at."""
    out = {} if out is None else out
    for at, node in _nodes(tree, keys):
        target = node.get("_target_") if isinstance(node, dict) else None
        if isinstance(target, str) and "${" not in target:
            out.setdefault(target, set()).add(slot(at))
    return out


@cache
def slots() -> dict[str, frozenset[str]]:
    """Every target conf/'s YAML files name -> the slots it is built in (a file at its group, `_global_` at the top)."""
    import yaml

    out: dict[str, set[str]] = {}
    for path in sorted(Path(CONFIG_DIR).rglob("*.y*ml")):
        text = path.read_text(encoding="utf-8")
        head = text.splitlines()[:5]
        glob = any(line.strip().replace(" ", "") == "#@package_global_" for line in head)
        group = path.relative_to(CONFIG_DIR).parent.parts
        _placed(yaml.safe_load(text), () if glob else group, out)
    return {t: frozenset(s) for t, s in out.items()}  # frozen: one cached copy serves every caller


def shipped() -> frozenset[str]:
    """The targets every YAML file of the package's conf/ tree names."""
    return frozenset(slots())


def searched(searchpath: tuple[str, ...]) -> set[str]:
    """The targets the config files of these search-path entries name, read by Hydra's own config sources."""
    from hydra._internal import config_repository, config_search_path_impl, sources_registry
    from hydra._internal.core_plugins import file_config_source as files
    from hydra._internal.core_plugins import importlib_resources_config_source as packages
    from hydra.core.object_type import ObjectType

    for source_type in (files.FileConfigSource, packages.ImportlibResourcesConfigSource):
        sources_registry.SourcesRegistry.instance().register(source_type)
    csp = config_search_path_impl.ConfigSearchPathImpl()
    for entry in searchpath:
        csp.append("hydra.searchpath in command-line", entry)
    out: set[str] = set()
    try:
        sources = config_repository.ConfigRepository(csp).get_sources()
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"hydra.searchpath: {first}") from None
    for source, entry in zip(sources, searchpath):
        if not source.available():
            why = "is not available (no such config directory, or a package without __init__.py)"
            raise ConfigError(f"hydra.searchpath: {entry} {why}")

        def walk(source, group: str) -> None:
            for name in source.list(group, ObjectType.CONFIG):
                config = source.load_config(f"{group}/{name}" if group else name).config
                out.update(_placed(OmegaConf.to_container(config, resolve=False)))
            for name in source.list(group, ObjectType.GROUP):
                walk(source, f"{group}/{name}" if group else name)

        walk(source, "")
    return out


def parse_overrides(overrides) -> list:
    """Hydra's own parse of command-line overrides; ConfigError, one line, for one it cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None


def as_given(overrides) -> list[str]:
    r"""Hydra's record of overrides (`hydra.overrides.task`, `.hydra`) as given: unresolved, a `\${` kept escaped."""
    return [str(o) for o in OmegaConf.to_container(overrides) or []]


def literal(text: str) -> str:
    r"""`text` as a value omegaconf resolves to `text`: it reads `\${` as `${` (the backslashes before, two for one)."""
    return re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)


def hydra_quoted(text: str) -> str:
    """`text` as an override value (alone or in a list) Hydra reads back as `text` (resolved: quote literal(text))."""
    # no `/`: `true`, `null`, `1.5` would not be text; ASCII only: Hydra's lexer takes no other letter unquoted
    if "/" in text and re.fullmatch(r"[\w/.:@%+-]+", text, re.ASCII):
        return text
    quote = '"' if '"' not in text else "'"
    # inside quotes Hydra reads `\` + quote as the quote and `\\` before a quote (or the closing one) as `\`
    body = re.sub(rf"(\\*)({quote}|$)", lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""), text)
    return quote + body + quote


@cache
def allowed(overrides: tuple[str, ...] = ()) -> frozenset[str]:
    """What the pipeline's configs, the user's `hydra.searchpath` and the command line name (only `pkg://` imported)."""
    searchpath: tuple[str, ...] = ()
    own: set[str] = set()
    for o in parse_overrides(overrides):
        value = o.value()
        if o.key_or_group == "hydra.searchpath":
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                msg = f"{o.input_line}: hydra.searchpath must be a list of config directories"
                raise ConfigError(msg)
            searchpath = tuple(value)
        else:  # `model._target_=x` names x as a node {_target_: x} would
            own.update(_placed({o.key_or_group.split(".")[-1]: value}))
    return shipped() | frozenset(searched(searchpath)) | frozenset(own)


def check(tree: dict, allowed_targets: frozenset[str]) -> None:
    """A config read from a file: UnknownTarget for a `_target_` not allowed or out of its place, or interpolation."""
    for keys, node in _nodes(tree):
        path = ".".join(("config", *keys))
        if isinstance(node, dict) and "_target_" in node:
            target, where = node["_target_"], f"{path}._target_"
            if not isinstance(target, str):
                raise UnknownTarget(f"{where} is {target!r:.80}, not the name of a class")
            if "${" not in target and target not in allowed_targets:
                why = f"{where} names {target!r:.200}, which neither the pipeline's configs nor yours name"
                raise UnknownTarget(f"{why} ({HINT})")
            _in_place(target, where, keys)
        elif isinstance(node, str) and "${" in node:
            why = "a saved config is resolved and holds none (it would be resolved when the node is built)"
            raise UnknownTarget(f"{path} holds the interpolation {node!r:.200}; {why}")


def _in_place(target: str, where: str, keys: tuple[str, ...]) -> None:
    parts = target.split(".")
    if len(parts) < 3 or parts[0] != "pipeline":
        return  # your own classes: built wherever your configs put them
    if target in slots():  # one of conf/'s own: only in a slot conf/ builds it in
        here, homes = slot(keys), sorted(slots()[target])
    else:  # another of the package's: under the node its package is built under
        here = (keys[0].split("[")[0] if keys else "") or "the top level"
        homes = [k for k, v in PLACES.items() if v == parts[1]]
    if here not in homes:
        said = f"a class the pipeline builds only under {' or '.join(homes) or 'no node'}"
        raise UnknownTarget(f"{where} names {target!r:.200}, {said}, never under {here}")
