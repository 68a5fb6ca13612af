"""Named arrays to and from safetensors: contiguous copies, tied arrays stored once as ALIAS(name)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

ALIAS = re.compile(r"^ALIAS\((.+)\)$")


def split_aliases(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Unique arrays by first name, and alias -> canonical name for every later name of the same object."""
    by_id: dict[int, str] = {}
    unique, aliases = {}, {}
    for name, a in arrays.items():
        if id(a) in by_id:
            aliases[name] = by_id[id(a)]
        else:
            by_id[id(a)] = name
            # safetensors writes non-contiguous arrays wrong, silently: always hand it C order.
            unique[name] = np.ascontiguousarray(a)
    return unique, aliases


def write_tensors(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    unique, aliases = split_aliases(arrays)
    meta = {"format": "np", **(metadata or {}), **{k: f"ALIAS({v})" for k, v in aliases.items()}}
    save_file(unique, str(path), metadata=meta)


def resolve_aliases(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> dict[str, np.ndarray]:
    """Every ALIAS(target) in metadata becomes the very object stored under target; raises ValueError."""
    links = {k: m.group(1) for k, v in metadata.items() if (m := ALIAS.match(v))}
    out = dict(arrays)
    for name in links:
        if name in arrays:
            raise ValueError(f"{name} is both stored and declared an alias")
        seen, target = {name}, links[name]
        while target in links:  # follow chains, refusing loops
            if target in seen:
                raise ValueError(f"circular alias {name} -> {target}")
            seen.add(target)
            target = links[target]
        if target not in arrays:
            raise ValueError(f"alias {name} -> {links[name]} names no stored tensor")
        out[name] = arrays[target]
    return out


def read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays (aliases resolved to one object) and the header metadata; raises ValueError on a bad file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
        # pread keeps peak memory at 1x the data (the default mmap path doubles it)
        arrays = load_file(str(path), backend="pread")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"unreadable safetensors ({e})") from e
    return resolve_aliases(arrays, metadata), metadata
