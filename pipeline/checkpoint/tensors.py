"""Named arrays to and from safetensors: contiguous copies, tied arrays stored once as ALIAS(name)."""
from __future__ import annotations

import json
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
    sort_metadata(path)


def sort_metadata(path: Path) -> None:
    """Rewrite the header's __metadata__ in sorted key order, in place and at the same length.

    safetensors serialises metadata from a hash map whose order changes from process to process, so the
    same state would hash differently in a resumed process; sorted, equal states give equal bytes.
    """
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        text = raw.rstrip(b" ")
        header = json.loads(text)
        if json.dumps(header, separators=(",", ":")).encode() != text:
            return  # not the compact form we can reproduce exactly: leave the library's bytes alone
        meta = dict(sorted(header.pop("__metadata__", {}).items()))
        tensors = sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0]))  # file order
        header = {"__metadata__": meta, **dict(tensors)} if meta else dict(tensors)
        fixed = json.dumps(header, separators=(",", ":")).encode()
        if len(fixed) == len(text):
            f.seek(8)
            f.write(fixed)


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
