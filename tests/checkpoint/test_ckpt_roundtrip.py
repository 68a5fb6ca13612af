"""Lab 02 blocks D, E, F: byte-equal state machines after a reload, bit-identical continuation (also in a
second process), weight tying; plus the safetensors traps (non-contiguous arrays) and RNG states in JSON.

Oracles: the state is compared in its live form (arrays with np.array_equal and dtypes, RNG states as
the generators report them), not through the checkpoint's own serialisation; the second process writes
its results with the safetensors library, read back here with the library.
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from pipeline.checkpoint import io
from pipeline.checkpoint.tensors import read_tensors, write_tensors
from pipeline.model.base import state_dict as model_state
from pipeline.rng import (Streams, numpy_state_from_json, numpy_state_to_json, python_state_from_json,
                          python_state_to_json)
from pipeline.roundtrip import facts_for, train

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MLP = ["experiment=kernodeck"]
# A small tied GPT on the grammar corpus, with dropout (so the dropout stream matters) and AdamW + cosine.
MINIGPT = ["model=minigpt", "data=grammar", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
           "model.block_size=16", "model.dropout=0.1", "data.n_sentences=2000", "trainer.batch_size=4",
           "trainer.dtype=float32", "trainer.seed=42", "trainer.max_steps=20", "optimizer=adamw", "scheduler=cosine"]
CASES = {"mlp": MLP, "minigpt": MINIGPT}


def minigpt_skip_reason() -> str | None:
    try:
        import pipeline.data.grammar  # noqa: F401
        import pipeline.model.minigpt  # noqa: F401
    except Exception as e:  # the model or the corpus is not there yet
        return f"minigpt variant needs pipeline.model.minigpt and pipeline.data.grammar: {type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt-roundtrip-out")  # one grammar corpus for the module


def compose_case(name: str, out_dir: Path, *extra: str):
    try:
        from conftest import compose_config  # tests/conftest.py: the real config, as python -m pipeline composes it
    except ImportError:
        from pipeline.roundtrip import compose as compose_config

    if name == "minigpt" and (reason := minigpt_skip_reason()):
        pytest.skip(reason)
    try:
        return compose_config([*CASES[name], f"paths.output_dir={out_dir}", *extra])
    except Exception as e:
        if name == "minigpt" and type(e).__module__.startswith("hydra"):
            pytest.skip(f"minigpt variant: config does not compose yet: {e}")
        raise


def build(cfg):
    from pipeline.build import build_state

    return build_state(cfg)


def live_state(state) -> dict[str, dict]:
    """Copies of the five state machines as the live objects hold them."""
    opt = state.optimizer.state_dict()
    return {
        "model": {k: v.copy() for k, v in model_state(state.model).items()},
        "optimizer": {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in opt.items()},
        "scheduler": dict(state.scheduler.state_dict()),
        "data_iter": {"epoch": state.iterator.epoch, "cursor": state.iterator.cursor,
                      "permutation": state.iterator.permutation.copy()},
        "rng": {**{n: g.bit_generator.state for n, g in state.streams.np.items()},
                **{n: r.getstate() for n, r in state.streams.py.items()}},
    }


def assert_byte_equal(a, b, where: str) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b), f"{where}: values differ"
        assert a.tobytes() == b.tobytes(), f"{where}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_byte_equal(a[k], b[k], f"{where}.{k}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def differs(a, b) -> bool:
    try:
        assert_byte_equal(a, b, "")
        return False
    except AssertionError:
        return True


# -- block D: per state machine ------------------------------------------------------------------

@pytest.fixture(scope="module", params=["mlp", "minigpt"])
def reloaded(request, out_dir, tmp_path_factory):
    cfg = compose_case(request.param, out_dir)
    state = build(cfg)
    train(state, 10)
    before = live_state(state)
    directory = tmp_path_factory.mktemp(f"d-{request.param}") / io.step_dir_name(state.step)
    io.save(state, directory, facts_for(cfg, state, directory.parent))
    fresh = build(cfg)
    untouched = live_state(fresh)
    io.apply(io.load(directory), fresh)
    return {"before": before, "untouched": untouched, "after": live_state(fresh), "state": state, "fresh": fresh}


@pytest.mark.parametrize("machine", io.STATE_MACHINES)
def test_state_machine_is_byte_equal_after_reload(reloaded, machine):
    before, after = reloaded["before"][machine], reloaded["after"][machine]
    # not vacuous: ten steps moved this machine away from what fresh objects start with
    assert differs(before, reloaded["untouched"][machine]), f"{machine}: training did not change it"
    assert_byte_equal(before, after, machine)


def test_progress_and_lr_restored(reloaded):
    state, fresh = reloaded["state"], reloaded["fresh"]
    assert (fresh.step, fresh.epoch) == (state.step, state.epoch) == (10, fresh.iterator.epoch)
    assert fresh.optimizer.t == state.optimizer.t == 10
    assert struct.pack("<d", fresh.optimizer.lr) == struct.pack("<d", state.optimizer.lr)


# -- block E: continuation -------------------------------------------------------------------------

def summary(state) -> dict[str, np.ndarray]:
    opt = state.optimizer.state_dict()
    return {**{f"model/{k}": v for k, v in state.model.params.items()},
            **{f"optim/{k}": v for k, v in opt.items() if isinstance(v, np.ndarray)}}


@pytest.fixture(scope="module", params=["mlp", "minigpt"])
def continuation(request, out_dir, tmp_path_factory):
    cfg = compose_case(request.param, out_dir)
    reference = build(cfg)
    losses_ref = train(reference, 20)
    first = build(cfg)
    losses_a = train(first, 10)
    directory = tmp_path_factory.mktemp(f"e-{request.param}") / io.step_dir_name(10)
    io.save(first, directory, facts_for(cfg, first, directory.parent))
    return {"name": request.param, "cfg": cfg, "reference": reference, "losses_ref": losses_ref,
            "losses_a": losses_a, "directory": directory}


def test_continuation_in_process_is_bit_identical(continuation):
    c = continuation
    second = build(c["cfg"])
    io.apply(io.load(c["directory"]), second)
    losses_b = train(second, 10)
    np.testing.assert_array_equal(np.array(c["losses_ref"]), np.array(c["losses_a"] + losses_b))
    ref, got = summary(c["reference"]), summary(second)
    assert ref.keys() == got.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and np.array_equal(ref[k], got[k]), k
    assert (second.optimizer.t, second.step) == (c["reference"].optimizer.t, c["reference"].step) == (20, 20)
    assert second.optimizer.lr == c["reference"].optimizer.lr


CHILD = r"""
import json, sys
import numpy as np
from hydra import compose, initialize_config_dir
from safetensors.numpy import save_file
import pipeline.config
from pipeline.build import build_state
from pipeline.checkpoint import io
from pipeline.trainer.loop import train_step

overrides, checkpoint, steps, out = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
pipeline.config.register_all()
with initialize_config_dir(config_dir=str(pipeline.config.CONFIG_DIR), version_base="1.3", job_name="child"):
    cfg = compose(config_name="config", overrides=overrides)
state = build_state(cfg)
io.apply(io.load(checkpoint), state)
losses = [train_step(state)["train/loss"] for _ in range(steps)]
arrays = {"losses": np.array(losses, dtype=np.float64)}
arrays.update({"model/" + k: v for k, v in state.model.params.items()})
arrays.update({"optim/" + k: v for k, v in state.optimizer.state_dict().items() if isinstance(v, np.ndarray)})
save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, out + "/child.safetensors")
with open(out + "/child.json", "w") as f:
    json.dump({"t": state.optimizer.t, "lr": repr(state.optimizer.lr), "step": state.step}, f)
"""


def test_continuation_in_a_second_process_is_bit_identical(continuation, out_dir, tmp_path):
    c = continuation
    overrides = [*CASES[c["name"]], f"paths.output_dir={out_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), str(c["directory"]), "10", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(tmp_path / "child.safetensors"))
    meta = json.loads((tmp_path / "child.json").read_text())
    np.testing.assert_array_equal(np.array(c["losses_ref"]), np.concatenate([c["losses_a"], got.pop("losses")]))
    ref = summary(c["reference"])
    assert ref.keys() == got.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and np.array_equal(ref[k], got[k]), k
    assert meta == {"t": 20, "lr": repr(c["reference"].optimizer.lr), "step": 20}


# -- block F: weight tying -------------------------------------------------------------------------

def test_weight_tying_stored_once_and_one_object_after_load(out_dir, tmp_path):
    cfg = compose_case("minigpt", out_dir)
    state = build(cfg)
    train(state, 3)
    head, wte = "lm_head.weight", "transformer.wte.weight"
    assert state.model.aliases == {head: wte}
    live = model_state(state.model)
    assert live[head] is live[wte] is state.model.params[wte]
    directory = tmp_path / io.step_dir_name(3)
    io.save(state, directory, facts_for(cfg, state, tmp_path))

    path = directory / io.WEIGHTS
    unique = sum(p.nbytes for p in state.model.params.values())  # params holds each array once
    assert sum(a.nbytes for a in live.values()) - unique == live[wte].nbytes  # what an untied save would add
    size = path.stat().st_size
    assert abs(size - unique) < 4096, f"file size {size} vs unique parameters {unique}: tying broken?"
    with safe_open(str(path), "np") as f:  # the library's own reading of the header
        assert f.metadata()[head] == f"ALIAS({wte})"
        assert head not in f.keys() and wte in f.keys()

    ckpt = io.load(directory)
    assert ckpt.weights[head] is ckpt.weights[wte]
    fresh = build(cfg)
    assert not np.array_equal(fresh.model.params[wte], live[wte])
    io.apply(ckpt, fresh)
    fresh_live = model_state(fresh.model)
    assert fresh_live[head] is fresh_live[wte] is fresh.model.params[wte]
    assert fresh.model.lm_head is fresh.model.params[wte]
    assert np.array_equal(fresh.model.params[wte], live[wte]) and fresh.model.params[wte].dtype == np.float32


# -- the safetensors traps ---------------------------------------------------------------------------

def _views(w: np.ndarray) -> dict[str, np.ndarray]:
    """Arrays equal to `w` that are not C-contiguous."""
    big = np.zeros((w.shape[0], 2 * w.shape[1]), dtype=w.dtype)
    big[:, ::2] = w
    return {"fortran": np.asfortranarray(w), "transposed": np.ascontiguousarray(w.T).T,
            "strided": big[:, ::2], "reversed": np.ascontiguousarray(w[::-1])[::-1]}


@pytest.mark.parametrize("kind", ["fortran", "transposed", "strided", "reversed"])
def test_non_contiguous_parameter_round_trips(kind, out_dir, tmp_path):
    cfg = compose_case("mlp", out_dir)
    state = build(cfg)
    train(state, 3)
    name = "layers.0.weight"
    values = state.model.params[name].copy()
    view = _views(values)[kind]
    assert not view.flags.c_contiguous and np.array_equal(view, values)
    state.model.params[name] = view  # the optimizer shares this dict
    directory = tmp_path / io.step_dir_name(3)
    io.save(state, directory, facts_for(cfg, state, tmp_path))
    assert np.array_equal(load_file(str(directory / io.WEIGHTS))[name], values)  # the bytes on disk, per the library
    fresh = build(cfg)
    io.apply(io.load(directory), fresh)
    assert np.array_equal(fresh.model.params[name], values) and fresh.model.params[name].dtype == values.dtype


def test_writer_matches_the_library_and_reads_its_files(tmp_path):
    g = np.random.default_rng(0)
    arrays = {"a": g.standard_normal((3, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
              "scalar": np.array(2.5), "empty": np.zeros((0, 2)), "mask": np.array([True, False]),
              "half": g.standard_normal(3).astype(np.float16)}
    ours, lib = tmp_path / "ours.safetensors", tmp_path / "lib.safetensors"
    entry = write_tensors(ours, {**arrays, "tied": arrays["a"]}, {"x": "1"})
    save_file(arrays, str(lib), metadata={"format": "np", "x": "1", "tied": "ALIAS(a)"})
    a, b = ours.read_bytes(), lib.read_bytes()
    assert entry["size"] == len(a) and entry["sha256"] == __import__("hashlib").sha256(a).hexdigest()
    n = struct.unpack("<Q", a[:8])[0]
    assert len(a) == len(b) and a[:8] == b[:8] and a[8 + n:] == b[8 + n:]  # same layout and data
    assert json.loads(a[8:8 + n]) == json.loads(b[8:8 + n])  # same header (the library's metadata order varies)
    assert list(json.loads(a[8:8 + n])["__metadata__"]) == ["format", "tied", "x"]  # ours is sorted
    for path in (ours, lib):
        got, meta = read_tensors(path)
        assert meta["tied"] == "ALIAS(a)" and got["tied"] is got["a"]
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), (path.name, k)
    back = load_file(str(ours))
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v), k


# -- RNG states through JSON -------------------------------------------------------------------------

def test_pcg64_state_survives_json_exactly():
    g = np.random.Generator(np.random.PCG64(20261130))
    g.random(7)
    g.integers(0, 1000, size=3, dtype=np.uint32)  # leaves a buffered 32-bit half: has_uint32 = 1
    state = g.bit_generator.state
    assert state["has_uint32"] == 1 and state["state"]["state"] >= 2**64  # a genuinely 128-bit value
    text = json.dumps(numpy_state_to_json(g))
    # a JSON reader that turns every number into a double cannot damage decimal strings
    assert numpy_state_from_json(json.loads(text, parse_int=float)) == state
    h = np.random.Generator(np.random.PCG64(0))
    h.bit_generator.state = numpy_state_from_json(json.loads(text))
    assert np.array_equal(h.integers(0, 1000, size=5, dtype=np.uint32), g.integers(0, 1000, size=5, dtype=np.uint32))
    assert np.array_equal(h.random(5), g.random(5))


def test_python_random_state_survives_json_exactly():
    r = random.Random(5)
    r.random()
    r.gauss(0.0, 1.0)  # leaves gauss_next set
    state = r.getstate()
    assert state[2] is not None
    back = python_state_from_json(json.loads(json.dumps(python_state_to_json(r))))
    assert back == state
    s = random.Random(0)
    s.setstate(back)
    assert [s.gauss(0, 1), s.random(), s.getrandbits(64)] == [r.gauss(0, 1), r.random(), r.getrandbits(64)]


def test_streams_state_dict_survives_json():
    a = Streams(42)
    for name in a.np:
        a[name].random(3)
    a["python"].gauss(0, 1)
    b = Streams(7)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert {n: g.bit_generator.state for n, g in b.np.items()} == {n: g.bit_generator.state for n, g in a.np.items()}
    assert b["python"].getstate() == a["python"].getstate()
    assert b.peek() == a.peek()
