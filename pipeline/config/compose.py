"""Where the config lives, composing it as `python -m pipeline` does, the result as plain values; extras' hints."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.config.schemas import SCHEMAS, Config

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pipeline/
PROJECT_ROOT = PACKAGE_DIR.parent  # the checkout, when the package runs from one
# conf/ sits at the top of a checkout; a wheel carries it inside the package (setup.py maps it there).
CONFIG_DIR = PACKAGE_DIR / "conf" if (PACKAGE_DIR / "conf").is_dir() else PROJECT_ROOT / "conf"


def in_checkout() -> bool:
    """True when the package runs from a source checkout, False when installed (from a wheel)."""
    return (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "conf").is_dir()


def install_hint(extra: str) -> str:
    """How to add an optional extra as installed: `pip install -e` in an editable install or checkout, else pip's."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    try:
        dist = importlib.metadata.distribution("pipeline")
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        direct = None
    url = urlparse(direct.get("url", "")) if isinstance(direct, dict) else None
    if url and url.scheme == "file" and (direct.get("dir_info") or {}).get("editable"):
        project = Path(unquote(url.path))
    elif direct is None and in_checkout():
        project = PROJECT_ROOT
    else:
        return f"pip install 'pipeline[{extra}]'"
    return f'pip install -e ".[{extra}]" in {project}'


def default_output_dir() -> str:
    """<checkout>/outputs when the package runs from a source checkout, else outputs/ in the working directory."""
    return str((PROJECT_ROOT if in_checkout() else Path(os.getcwd())) / "outputs")


def register() -> None:
    """The `default_output_dir` and `experiment_name` resolvers, and every schema in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from pipeline.config.identity import experiment_name

    for resolver in (default_output_dir, experiment_name):
        if not OmegaConf.has_resolver(resolver.__name__):
            OmegaConf.register_new_resolver(resolver.__name__, resolver)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for schema in SCHEMAS.values():
        if schema.stored_as:
            group, name = schema.stored_as.rsplit("/", 1)
            cs.store(group=f"schema/{group}", name=name, node=schema)


def compose(overrides=(), return_hydra_config: bool = False):
    """conf/config.yaml composed with `overrides`, exactly as `python -m pipeline` would (nothing written)."""
    import hydra

    register()
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3", job_name="pipeline"):
        return hydra.compose("config", list(overrides), return_hydra_config=return_hydra_config)


def to_plain(cfg) -> dict:
    """A composed DictConfig as plain values (resolved, less `hydra`); omegaconf's error for a missing value."""
    from omegaconf import OmegaConf

    def values(node):
        if isinstance(node, dict):
            return {k: values(v) for k, v in node.items() if k != "hydra"}
        return [values(v) for v in node] if isinstance(node, list) else node

    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    return values(plain)  # an enum as its name: each of the schemas' is its value
