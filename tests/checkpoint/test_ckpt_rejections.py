"""Every way load() and apply() refuse a checkpoint: a one-line CheckpointError naming the directory, the
file and the reason, with no byte on disk changed (every file's bytes, mode and mtime are compared), and
live objects left as they were when apply() refuses.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pipeline.checkpoint import io
from pipeline.checkpoint.errors import CheckpointError
from pipeline.roundtrip import facts_for, train

MLP = ["experiment=kernodeck"]
MINIGPT = ["model=minigpt", "data=grammar", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
           "model.block_size=16", "data.n_sentences=2000", "trainer.dtype=float32"]


def compose(*overrides: str):
    try:
        from conftest import compose_config  # tests/conftest.py: the real config, as python -m pipeline composes it
    except ImportError:
        from pipeline.roundtrip import compose as compose_config
    return compose_config(list(overrides))


def build(cfg):
    from pipeline.build import build_state

    return build_state(cfg)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """One trained kernodeck checkpoint; each test damages its own copy."""
    root = tmp_path_factory.mktemp("reject-template")
    cfg = compose(*MLP, f"paths.output_dir={root}")
    state = build(cfg)
    train(state, 10)
    directory = root / io.step_dir_name(10)
    io.save(state, directory, facts_for(cfg, state, root))
    return directory


@pytest.fixture
def ckpt(template, tmp_path) -> Path:
    directory = tmp_path / "checkpoints" / template.name
    shutil.copytree(template, directory)
    return directory


def snapshot(root: Path) -> dict:
    """Every entry under root: its bytes (files), target (links), mode and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            content = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else None)
            out[str(p.relative_to(root))] = (content, st.st_mode, st.st_mtime_ns, st.st_size)
    return out


def rejects(directory: Path, file: str, *reason_words: str, state=None) -> CheckpointError:
    """load() (and apply() into `state`, if given) raises naming directory, file and reason; nothing changes."""
    root = directory.parent
    before = snapshot(root)
    with pytest.raises(CheckpointError) as info:
        ckpt = io.load(directory)
        if state is not None:
            io.apply(ckpt, state)
    e = info.value
    message = str(e)
    assert "\n" not in message, message
    assert str(directory) in message and f": {file}: " in message, message
    assert e.file == file and Path(e.directory) == directory
    for word in reason_words:
        assert word in e.reason, message
    assert snapshot(root) == before, "rejecting a checkpoint changed something on disk"
    return e


def manifest_of(directory: Path) -> dict:
    return json.loads((directory / io.MANIFEST).read_text())


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / io.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def relist(directory: Path, name: str) -> None:
    """Record a file's new size and sha256 in the manifest, as if it had been written that way."""
    m = manifest_of(directory)
    data = (directory / name).read_bytes()
    m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(directory, m)


def data_offset(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def rewrite_weights(directory: Path, arrays: dict, metadata: dict) -> None:
    """weights.safetensors made by the safetensors library itself, then listed in the manifest."""
    path = directory / io.WEIGHTS
    path.unlink()
    save_file(arrays, str(path), metadata=metadata)
    relist(directory, io.WEIGHTS)


# -- load(): the files ---------------------------------------------------------------------------

def test_missing_manifest(ckpt):
    (ckpt / io.MANIFEST).unlink()
    rejects(ckpt, io.MANIFEST, "missing")


def test_manifest_not_json(ckpt):
    (ckpt / io.MANIFEST).write_text("{not json")
    rejects(ckpt, io.MANIFEST, "not valid JSON")


def test_bad_schema_version(ckpt):
    m = manifest_of(ckpt)
    m["schema_version"] = "2.0"
    write_manifest(ckpt, m)
    rejects(ckpt, io.MANIFEST, "schema_version", "'2.0'")


@pytest.mark.parametrize("name", [io.WEIGHTS, io.EXTRA])
def test_size_mismatch(ckpt, name):
    with open(ckpt / name, "ab") as f:
        f.write(b" ")
    rejects(ckpt, name, "size", "manifest says")


def test_truncated_file(ckpt):
    path = ckpt / io.OPTIM
    path.write_bytes(path.read_bytes()[:-1])
    rejects(ckpt, io.OPTIM, "size")


@pytest.mark.parametrize("name", [io.WEIGHTS, io.OPTIM])
def test_one_flipped_bit_in_tensor_data(ckpt, name):
    path = ckpt / name
    flip_bit(path, data_offset(path) + 3, bit=5)  # inside the first tensor's bytes; size unchanged
    # The trap this guards: safetensors itself has no checksum and loads the damaged value silently.
    assert name != io.WEIGHTS or load_file(str(path))  # still "valid" to the library
    rejects(ckpt, name, "sha256")


def test_one_flipped_bit_in_the_header(ckpt):
    path = ckpt / io.WEIGHTS
    flip_bit(path, 12, bit=1)  # inside the JSON header: unparseable, but reported as what it is, corruption
    rejects(ckpt, io.WEIGHTS, "sha256")


def test_one_flipped_bit_in_extra_json(ckpt):
    flip_bit(ckpt / io.EXTRA, 40, bit=0)
    rejects(ckpt, io.EXTRA, "sha256")


def test_missing_listed_file(ckpt):
    (ckpt / io.OPTIM).unlink()
    rejects(ckpt, io.OPTIM, "listed in manifest.json but missing")


@pytest.mark.parametrize("name", ["notes.txt", ".tmp-weights.safetensors"])
def test_unlisted_extra_file(ckpt, name):
    (ckpt / name).write_text("x")
    rejects(ckpt, name, "not listed")


def test_manifest_not_listing_a_required_file(ckpt):
    m = manifest_of(ckpt)
    del m["files"][io.OPTIM]
    (ckpt / io.OPTIM).unlink()
    write_manifest(ckpt, m)
    rejects(ckpt, io.MANIFEST, "does not list", io.OPTIM)


def test_manifest_entry_escaping_the_directory(ckpt):
    m = manifest_of(ckpt)
    m["files"]["../escape"] = m["files"][io.EXTRA]
    write_manifest(ckpt, m)
    rejects(ckpt, io.MANIFEST, "invalid file name")


def test_manifest_step_differs_from_extra(ckpt):
    extra = json.loads((ckpt / io.EXTRA).read_text())
    extra["step"] = 11
    (ckpt / io.EXTRA).write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    relist(ckpt, io.EXTRA)  # past the sha256 check: only the incoherence is left
    rejects(ckpt, io.EXTRA, "step 11", "manifest.json")


def test_optimizer_t_differs_from_extra(ckpt):
    arrays = load_file(str(ckpt / io.OPTIM))
    arrays["t"] = np.array([9], dtype=np.int64)
    (ckpt / io.OPTIM).unlink()
    save_file(arrays, str(ckpt / io.OPTIM), metadata={"format": "np", "t": "9"})
    relist(ckpt, io.OPTIM)
    rejects(ckpt, io.OPTIM, "t")


def test_unknown_alias(ckpt):
    arrays = load_file(str(ckpt / io.WEIGHTS))
    rewrite_weights(ckpt, arrays, {"format": "np", "lm_head.weight": "ALIAS(transformer.wte.weight)"})
    rejects(ckpt, io.WEIGHTS, "alias", "names no stored tensor")


def test_circular_alias(ckpt):
    arrays = load_file(str(ckpt / io.WEIGHTS))
    rewrite_weights(ckpt, arrays, {"format": "np", "a.weight": "ALIAS(b.weight)", "b.weight": "ALIAS(a.weight)"})
    rejects(ckpt, io.WEIGHTS, "circular alias a.weight -> b.weight -> a.weight")


def test_alias_that_is_also_stored(ckpt):
    arrays = load_file(str(ckpt / io.WEIGHTS))
    rewrite_weights(ckpt, arrays, {"format": "np", "layers.1.bias": "ALIAS(layers.0.bias)"})
    rejects(ckpt, io.WEIGHTS, "both stored and declared an alias")


def test_safetensors_header_lying_about_offsets(ckpt):
    path = ckpt / io.WEIGHTS
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    relist(ckpt, io.WEIGHTS)
    rejects(ckpt, io.WEIGHTS, "not a valid safetensors file")


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        io.load(tmp_path / "nowhere")


# -- apply(): the live objects ------------------------------------------------------------------------

def live_snapshot(state) -> dict:
    return {"params": {k: v.copy() for k, v in state.model.params.items()},
            "optim": {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in state.optimizer.state_dict().items()},
            "sched": state.scheduler.state_dict(), "perm": state.iterator.permutation.copy(),
            "pos": (state.iterator.epoch, state.iterator.cursor, state.step),
            "rng": {n: g.bit_generator.state for n, g in state.streams.np.items()}}


def assert_untouched(state, before: dict) -> None:
    after = live_snapshot(state)
    for k, v in before["params"].items():
        assert np.array_equal(after["params"][k], v), k
    assert after["optim"].keys() == before["optim"].keys()
    for k, v in before["optim"].items():
        assert np.array_equal(after["optim"][k], v) if isinstance(v, np.ndarray) else after["optim"][k] == v, k
    assert (after["sched"], after["pos"], after["rng"]) == (before["sched"], before["pos"], before["rng"])
    assert np.array_equal(after["perm"], before["perm"])


@pytest.mark.parametrize("overrides, file, words", [
    (["model.hidden=[8,8]"], io.WEIGHTS, ["keys differ", "the checkpoint lacks ['layers.2.bias', 'layers.2.weight']"]),
    (["model.hidden=[16]"], io.WEIGHTS, ["layers.0.bias", "float64[8]", "float64[16]"]),
    (["trainer.dtype=float32"], io.WEIGHTS, ["float64", "float32"]),
    (["optimizer=sgd", "optimizer.momentum=0.9"], io.OPTIM, ["optimizer", "keys differ"]),
], ids=["extra-layer", "wider", "float32-run", "sgd-momentum"])
def test_checkpoint_that_does_not_fit_the_live_run(ckpt, tmp_path, overrides, file, words):
    state = build(compose(*MLP, f"paths.output_dir={tmp_path}", *overrides))
    before = live_snapshot(state)
    rejects(ckpt, file, "does not fit the live run", *words, state=state)
    assert_untouched(state, before)  # checked before anything was restored


def test_checkpoint_missing_a_key_the_model_has(ckpt, tmp_path):
    arrays = load_file(str(ckpt / io.WEIGHTS))
    del arrays["layers.1.bias"]
    rewrite_weights(ckpt, arrays, {"format": "np"})
    state = build(compose(*MLP, f"paths.output_dir={tmp_path}"))
    before = live_snapshot(state)
    rejects(ckpt, io.WEIGHTS, "the checkpoint lacks ['layers.1.bias']", state=state)
    assert_untouched(state, before)


def test_checkpoint_with_a_key_the_model_lacks(ckpt, tmp_path):
    arrays = load_file(str(ckpt / io.WEIGHTS))
    arrays["layers.9.weight"] = np.zeros((2, 2))
    rewrite_weights(ckpt, arrays, {"format": "np"})
    state = build(compose(*MLP, f"paths.output_dir={tmp_path}"))
    rejects(ckpt, io.WEIGHTS, "the live run has no ['layers.9.weight']", state=state)


def test_incoherent_rng_state_leaves_live_objects_untouched(ckpt, tmp_path):
    extra = json.loads((ckpt / io.EXTRA).read_text())
    del extra["rng"]["dropout"]["inc"]
    (ckpt / io.EXTRA).write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    relist(ckpt, io.EXTRA)
    state = build(compose(*MLP, f"paths.output_dir={tmp_path}"))
    before = live_snapshot(state)
    rejects(ckpt, io.EXTRA, "rng stream 'dropout'", "missing key 'inc'", state=state)
    assert_untouched(state, before)  # the model came first in the restore order, yet was not touched


def test_untied_head_into_a_tied_model(tmp_path):
    """A checkpoint storing lm_head.weight on its own must not be dropped silently into a tied model."""
    try:
        import pipeline.data.grammar  # noqa: F401
        import pipeline.model.minigpt  # noqa: F401
    except Exception as e:
        pytest.skip(f"minigpt variant needs pipeline.model.minigpt and pipeline.data.grammar: {e}")
    cfg = compose(*MINIGPT, f"paths.output_dir={tmp_path}")
    state = build(cfg)
    directory = tmp_path / "checkpoints" / io.step_dir_name(0)
    io.save(state, directory, facts_for(cfg, state, tmp_path))
    arrays = load_file(str(directory / io.WEIGHTS))
    arrays["lm_head.weight"] = arrays["transformer.wte.weight"] + np.float32(1)
    rewrite_weights(directory, arrays, {"format": "np"})
    rejects(directory, io.WEIGHTS, "tied names differ", state=build(cfg))
