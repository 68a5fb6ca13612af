"""The checkpoint store (pipeline/checkpoint/store.py): all-or-nothing writes, full verification on load,
and every refusal one line naming the directory, the file and the reason, with nothing on disk changed and
the live objects untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import KERNODECK, TINY, env_for_subprocess, relist, tree
from safetensors.numpy import load_file, save_file

from pipeline.checkpoint.directory import (
    CORRUPTED,
    EXTRA,
    MANIFEST,
    OPTIM,
    WEIGHTS,
    CheckpointDir,
    files_of,
    step_dir_name,
)
from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.store import CheckpointStore
from pipeline.config.compose import compose, to_plain
from pipeline.files.atomic import TMP_PREFIX
from pipeline.stateful import PARTS, StateMismatch, capture, check, copy_tree, restore
from pipeline.verify.worker import Fresh


def fresh(tmp_path, *overrides: str, base=KERNODECK) -> Fresh:
    return Fresh(to_plain(compose([*base, f"paths.output_dir={tmp_path / 'out'}", *overrides])))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One trained kernodeck checkpoint; each test damages its own copy."""
    root = tmp_path_factory.mktemp("store")
    run = fresh(root)
    run.train(10)
    directory = root / "checkpoints" / step_dir_name(10)
    run.save(directory)
    return directory


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    directory = tmp_path / "checkpoints" / saved.name
    directory.mkdir(parents=True)
    for p in saved.iterdir():
        (directory / p.name).write_bytes(p.read_bytes())
    return directory


def rejects(
    directory: Path, file: str, *reason_words: str, run: Fresh | None = None
) -> CheckpointError:
    """CheckpointDir.load() raises naming directory, file and reason, changing nothing on disk or in `run`."""
    root = directory.parent
    before = tree(root, mtimes="all")
    run = run or fresh(directory.parent.parent)
    live = copy_tree(capture(run.parts))
    with pytest.raises(CheckpointError) as info:
        run.load(directory)
    e = info.value
    message = str(e)
    assert "\n" not in message, message
    assert str(directory) in message and f": {file}: " in message, message
    assert e.file == file and Path(e.directory) == directory
    for word in reason_words:
        assert word in e.reason, message
    assert tree(root, mtimes="all") == before, "rejecting a checkpoint changed something on disk"
    assert_same_tree(capture(run.parts), live)
    return e


def assert_same_tree(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def manifest_of(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def data_offset(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def rewrite_weights(directory: Path, arrays: dict, metadata: dict) -> None:
    """weights.safetensors made by the safetensors library itself, then listed in the manifest."""
    path = directory / WEIGHTS
    path.unlink()
    save_file(arrays, str(path), metadata=metadata)
    relist(directory, WEIGHTS)


def edit_extra(directory: Path, change) -> None:
    extra = json.loads((directory / EXTRA).read_text())
    change(extra)
    (directory / EXTRA).write_text(json.dumps(extra))
    relist(directory, EXTRA)


# -- the round trip -------------------------------------------------------------------------------------


def test_every_part_is_byte_equal_after_a_round_trip(tmp_path):
    run = fresh(tmp_path)
    run.train(7)
    before = copy_tree(capture(run.parts))
    run.save(tmp_path / "c")
    other = fresh(tmp_path)
    untouched = copy_tree(capture(other.parts))
    other.load(tmp_path / "c")
    assert_same_tree(capture(other.parts), before)
    # a part the fresh objects already matched proves nothing about its restore
    trained = [p for p in PARTS if p not in ("stages",)]
    for p in trained:
        with pytest.raises(AssertionError):
            assert_same_tree(untouched[p], before[p])


def test_the_files_hold_the_tree_as_documented(saved):
    weights, optim = load_file(str(saved / WEIGHTS)), load_file(str(saved / OPTIM))
    assert set(weights) == {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}
    assert {k.split("/")[0] for k in optim} == {"optimizer"}  # the iterator's state: a few integers
    extra = json.loads((saved / EXTRA).read_text())
    assert set(extra) == set(PARTS) - {"model"}
    assert (
        extra["optimizer"]["t"] == 10
        and extra["progress"]["step"] == 10
        and set(extra["data_iter"]) == {"epoch", "cursor", "start"}
    )
    m = manifest_of(saved)
    assert (
        m["files"][WEIGHTS]["sha256"] == hashlib.sha256((saved / WEIGHTS).read_bytes()).hexdigest()
    )


def test_tied_weights_are_stored_once_and_one_object_after_load(tmp_path):
    run = fresh(tmp_path, base=TINY)
    run.train(2)
    run.save(tmp_path / "c")
    with open(tmp_path / "c" / WEIGHTS, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert "lm_head.weight" not in header
    assert header["__metadata__"]["lm_head.weight"] == "ALIAS(transformer.wte.weight)"
    ckpt = CheckpointDir(tmp_path / "c").load(run.parts)
    assert ckpt.state["model"]["lm_head.weight"] is ckpt.state["model"]["transformer.wte.weight"]
    other = fresh(tmp_path, base=TINY)
    other.load(tmp_path / "c")
    assert (
        other.state.model.state_dict()["lm_head.weight"]
        is other.state.model.params["transformer.wte.weight"]
    )


def test_the_library_reads_our_files_and_we_read_its_files(saved, tmp_path):
    ours = load_file(str(saved / OPTIM))
    d = tmp_path / "lib"
    d.mkdir()
    save_file(ours, str(d / "x.safetensors"))
    from pipeline.checkpoint.tensors import read_tensors

    back, _ = read_tensors(d / "x.safetensors")
    assert set(back) == set(ours) and all(np.array_equal(back[k], ours[k]) for k in ours)


def test_equal_states_give_equal_bytes(tmp_path):
    for d in ("a", "b"):
        run = fresh(tmp_path)
        run.train(4)
        run.save(tmp_path / d)
    for name in (WEIGHTS, OPTIM, EXTRA):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# -- all or nothing ---------------------------------------------------------------------------------------


def temporaries(parent: Path) -> list[str]:
    return (
        sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP_PREFIX))
        if parent.is_dir()
        else []
    )


SAVE_POINTS = {1: "after weights", 3: "before manifest", 4: "before rename", 5: "after rename"}


@pytest.mark.parametrize("k", sorted(SAVE_POINTS), ids=list(SAVE_POINTS.values()))
def test_a_save_killed_with_sigkill_is_all_or_nothing(tmp_path, k):
    """A real kill -9 at the k-th save point (pipeline/files/killpoint.py), in a separate process."""
    out = tmp_path / "saves"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.roundtrip",
        "--save-to",
        str(tmp_path),
        "--steps",
        "4",
        "--",
        *KERNODECK,
        f"paths.output_dir={tmp_path / 'out'}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env={**env_for_subprocess(), "PIPELINE_CHAOS": f"save:{k}"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = CheckpointStore(out)
    if SAVE_POINTS[k] == "after rename":
        assert [s for s, _ in store.steps()] == [4] and temporaries(out) == []
        CheckpointDir(out / step_dir_name(4)).load()  # visible means complete
        return
    assert store.steps() == [] and len(temporaries(out)) == 1  # readers see nothing
    again = subprocess.run(
        cmd, cwd=tmp_path, env=env_for_subprocess(), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert temporaries(out) == [] and [s for s, _ in store.steps()] == [
        4
    ]  # the next save cleaned up
    CheckpointDir(out / step_dir_name(4)).load()


def test_a_save_over_an_existing_step_replaces_it_whole(tmp_path):
    """Never keeps another history's (or a damaged) directory at the same step."""
    a, b = fresh(tmp_path), fresh(tmp_path, "optimizer.lr=0.05")
    a.train(3)
    b.train(3)
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(3, capture(a.parts), a.fields())
    store.save(3, capture(b.parts), b.fields())
    ckpt = CheckpointDir(tmp_path / "checkpoints" / step_dir_name(3)).load(b.parts)
    assert ckpt.manifest["config"]["optimizer"]["lr"] == 0.05 and temporaries(store.root) == []


# -- CheckpointDir.load(): the files ---------------------------------------------------------------------------


def test_missing_manifest(ckpt):
    (ckpt / MANIFEST).unlink()
    rejects(ckpt, MANIFEST, "missing")


def test_manifest_not_json(ckpt):
    (ckpt / MANIFEST).write_text("{not json")
    rejects(ckpt, MANIFEST, "not valid JSON")


def test_bad_schema_version_names_both(ckpt):
    m = manifest_of(ckpt)
    m["schema_version"] = "1.0"
    write_manifest(ckpt, m)
    rejects(ckpt, MANIFEST, "schema_version '1.0'", "'2.0'")


def test_an_edited_config_is_caught_by_its_own_hash(ckpt):
    """Regression (#10.4): editing `config` left a stale config_hash that inspect accepted."""
    m = manifest_of(ckpt)
    m["config"]["optimizer"]["lr"] = 0.5
    write_manifest(ckpt, m)
    rejects(ckpt, MANIFEST, "config_hash", "edited")


def test_an_edited_seed_is_caught(ckpt):
    m = manifest_of(ckpt)
    m["seed"] = 7
    write_manifest(ckpt, m)
    rejects(ckpt, MANIFEST, "seed")


@pytest.mark.parametrize("name", [WEIGHTS, EXTRA])
def test_size_mismatch(ckpt, name):
    with open(ckpt / name, "ab") as f:
        f.write(b" ")
    rejects(ckpt, name, "size", "manifest says")


def test_truncated_file(ckpt):
    path = ckpt / OPTIM
    path.write_bytes(path.read_bytes()[:-1])
    rejects(ckpt, OPTIM, "size")


@pytest.mark.parametrize("name", [WEIGHTS, OPTIM])
def test_one_flipped_bit_in_tensor_data(ckpt, name):
    path = ckpt / name
    flip_bit(path, data_offset(path) + 3, bit=5)  # inside the first tensor's bytes; size unchanged
    # The trap this guards: safetensors itself has no checksum and loads the damaged value silently.
    assert load_file(str(path))  # still "valid" to the library
    rejects(ckpt, name, "sha256")


def test_one_flipped_bit_in_the_header(ckpt):
    flip_bit(
        ckpt / WEIGHTS, 12, bit=1
    )  # inside the JSON header: reported as what it is, corruption
    rejects(ckpt, WEIGHTS, "sha256")


def test_one_flipped_bit_in_extra_json(ckpt):
    flip_bit(ckpt / EXTRA, 40, bit=0)
    rejects(ckpt, EXTRA, "sha256")


def test_missing_listed_file(ckpt):
    (ckpt / OPTIM).unlink()
    rejects(ckpt, OPTIM, "listed in manifest.json but missing")


@pytest.mark.parametrize("name", ["notes.txt", ".tmp-weights.safetensors"])
def test_unlisted_extra_file(ckpt, name):
    (ckpt / name).write_text("x")
    rejects(ckpt, name, "not listed")


def test_manifest_not_listing_a_required_file(ckpt):
    m = manifest_of(ckpt)
    del m["files"][OPTIM]
    (ckpt / OPTIM).unlink()
    write_manifest(ckpt, m)
    rejects(ckpt, MANIFEST, "does not list", OPTIM)


def test_manifest_entry_escaping_the_directory(ckpt):
    m = manifest_of(ckpt)
    m["files"]["../escape"] = m["files"][EXTRA]
    write_manifest(ckpt, m)
    rejects(ckpt, MANIFEST, "invalid file name")


def test_manifest_step_differs_from_extra(ckpt):
    edit_extra(ckpt, lambda e: e["progress"].__setitem__("step", 11))  # past the sha256 check
    rejects(ckpt, EXTRA, "progress.step 11 differs from step 10 of manifest.json")


def test_unknown_alias(ckpt):
    arrays = load_file(str(ckpt / WEIGHTS))
    rewrite_weights(
        ckpt, arrays, {"format": "np", "lm_head.weight": "ALIAS(transformer.wte.weight)"}
    )
    rejects(ckpt, WEIGHTS)


def test_circular_alias(ckpt):
    arrays = load_file(str(ckpt / WEIGHTS))
    rewrite_weights(
        ckpt, arrays, {"format": "np", "a.weight": "ALIAS(b.weight)", "b.weight": "ALIAS(a.weight)"}
    )
    rejects(ckpt, WEIGHTS)


def test_safetensors_header_lying_about_offsets(ckpt):
    path = ckpt / WEIGHTS
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    relist(ckpt, WEIGHTS)
    rejects(ckpt, WEIGHTS, "not a valid safetensors file")


@pytest.mark.parametrize(
    "file, change, key",
    [
        (
            OPTIM,
            lambda a: a.__setitem__("model/layers.0.bias", a["optimizer/exp_avg/layers.0.bias"]),
            "model/layers.0.bias",
        ),
        (OPTIM, lambda a: a.__setitem__("nobody/x", np.zeros(2)), "nobody/x"),
        (OPTIM, lambda a: a.__setitem__("scheduler", np.zeros(2)), "scheduler"),
        (EXTRA, lambda e: e.__setitem__("model", {"layers.0.bias": [0.0] * 8}), "model"),
        (EXTRA, lambda e: e.__setitem__("nobody", {}), "nobody"),
    ],
    ids=[
        "model-in-optim",
        "no-part-in-optim",
        "a-part-itself-in-optim",
        "model-in-extra",
        "no-part-in-extra",
    ],
)
def test_a_key_outside_its_files_namespace_is_refused(ckpt, file, change, key):
    """Each file holds its own parts' keys (weights.safetensors the model's; optim.safetensors and extra.json
    the other parts'): a key the file may not hold is refused naming it, with or without the live run, never
    merged in to be dropped or to shadow what the right file holds."""
    (rewrite_optim if file == OPTIM else edit_extra)(ckpt, change)
    with pytest.raises(CheckpointError) as info:
        CheckpointDir(ckpt).load()
    assert info.value.file == file and info.value.reason.startswith(
        f"{'tensor' if file == OPTIM else 'key'} {key!r} is the state of no part"
    ), info.value
    rejects(ckpt, file)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointDir(tmp_path / "nowhere").load()


# -- restore: the live objects ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, file, words",
    [
        (
            ["model.hidden=[8,8]"],
            WEIGHTS,
            ["does not fit", "lacks ['layers.2.bias', 'layers.2.weight']"],
        ),
        (["model.hidden=[16]"], WEIGHTS, ["layers.0.bias", "F64[8]", "F64[16]"]),
        (["trainer.dtype=float32"], WEIGHTS, ["F64", "F32"]),
        (
            ["optimizer=sgd", "optimizer.momentum=0.9"],
            OPTIM,
            ["does not fit", "optimizer/momentum_buffer"],
        ),
    ],
    ids=["extra-layer", "wider", "float32-run", "sgd-momentum"],
)
def test_checkpoint_that_does_not_fit_the_live_run(ckpt, overrides, file, words):
    rejects(ckpt, file, *words, run=fresh(ckpt.parent.parent, *overrides))


@pytest.mark.parametrize(
    "change, part",
    [
        (lambda e: e["rng"]["dropout"].pop("inc"), "rng"),
        (lambda e: e["rng"]["python"].__setitem__("internal", [1, 2, 3]), "rng"),
        (lambda e: e["data_iter"].__setitem__("cursor", 99), "data_iter"),
        (lambda e: e["stages"]["best_val"].__setitem__("best", "low"), "stages"),
        (lambda e: e["stages"]["best_val"].__setitem__("best_step", [1]), "stages"),
        (lambda e: e["scheduler"].__setitem__("last_epoch", -3), "scheduler"),
        (lambda e: e["progress"]["metrics"].__setitem__("val/loss", "low"), "progress"),
    ],
    ids=[
        "rng-inc",
        "python-state",
        "cursor",
        "best-type",
        "best-step-type",
        "last-epoch",
        "metric",
    ],
)
def test_an_incoherent_json_state_leaves_live_objects_untouched(ckpt, change, part):
    edit_extra(ckpt, change)
    run = fresh(ckpt.parent.parent)
    live = copy_tree(capture(run.parts))
    error = rejects(
        ckpt, EXTRA, part, "does not fit", run=run
    )  # verifying against the live parts refuses it
    assert error.reason.startswith(f"{part} does not fit the live run")
    ckpt_state = CheckpointDir(ckpt).load().state  # the files alone are fine ...
    with pytest.raises(StateMismatch) as info:  # ... and restoring them refuses, all or nothing
        restore(run.parts, ckpt_state)
    assert info.value.part == part
    assert_same_tree(
        capture(run.parts), live
    )  # the model came first in the restore order, yet untouched


def test_untied_head_into_a_tied_model(tmp_path):
    """A checkpoint storing lm_head.weight on its own must not be dropped silently into a tied model."""
    run = fresh(tmp_path, base=TINY)
    run.save(tmp_path / "c")
    arrays = load_file(str(tmp_path / "c" / WEIGHTS))
    arrays["lm_head.weight"] = arrays["transformer.wte.weight"] + np.float32(1)
    rewrite_weights(tmp_path / "c", arrays, {"format": "np"})
    rejects(tmp_path / "c", WEIGHTS, "does not fit", run=fresh(tmp_path, base=TINY))


# -- the file named is the file that holds the damage ---------------------------------------------------


def rewrite_optim(directory: Path, change) -> None:
    """optim.safetensors rewritten by the safetensors library after `change(arrays)`, hashes recomputed."""
    arrays = load_file(str(directory / OPTIM))
    change(arrays)
    (directory / OPTIM).unlink()
    save_file(arrays, str(directory / OPTIM), metadata={"format": "np"})
    relist(directory, OPTIM)


def afe8033(change):
    """A change to a checkpoint in afe8033's form: its iterator's permutation (of kernodeck's 24 rows) in
    optim.safetensors, no `start` in extra.json."""
    change.afe8033 = True
    return change


def swap_two(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a[0] = a[1]  # one sample id twice, another never: same shape and dtype, not a permutation
    return a


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda a: a.__setitem__("optimizer/exp_avg/layers.0.bias", np.zeros(9)),
            ["optimizer/exp_avg/layers.0.bias"],
        ),
        (
            lambda a: a.__setitem__("optimizer/exp_avg_sq/layers.0.bias", np.zeros(8, np.float32)),
            ["exp_avg_sq", "F32"],
        ),
        (
            afe8033(lambda a: a.__setitem__("data_iter/permutation", swap_two(np.arange(24)))),
            ["data_iter does not fit", "not a permutation"],
        ),
        (
            afe8033(
                lambda a: a.__setitem__("data_iter/permutation", np.arange(24, dtype=np.int32))
            ),
            ["data_iter/permutation", "I32"],
        ),
    ],
    ids=["moment-shape", "moment-dtype", "permutation-values", "permutation-dtype"],
)
def test_an_array_that_does_not_fit_is_blamed_on_optim(ckpt, change, words):
    if (
        "permutation" in words[-1] or "I32" in words
    ):  # afe8033's form: its iterator's permutation (24 rows)
        edit_extra(ckpt, lambda e: e["data_iter"].pop("start"))
    rewrite_optim(ckpt, change)
    rejects(ckpt, OPTIM, *words)


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda e: e["optimizer"].__setitem__("t", "ten"),
            ["optimizer does not fit", "t: expected int, got str"],
        ),
        (lambda e: e["optimizer"].__setitem__("t", -1), ["t=-1 is negative"]),
        (lambda e: e["data_iter"].__setitem__("epoch", -1), ["epoch -1"]),
    ],
    ids=["counter-type", "counter-negative", "iterator-epoch"],
)
def test_a_json_value_that_does_not_fit_is_blamed_on_extra(ckpt, change, words):
    edit_extra(ckpt, change)  # the optimizer's and the iterator's JSON values, beside their arrays
    rejects(ckpt, EXTRA, *words)


def test_an_array_where_json_was_names_both_files(ckpt):
    """The files' layout check refuses such a checkpoint first (optim.safetensors has an unexpected tensor);
    restoring a tree that has one (a resume with allowed changes) names both files."""
    edit_extra(ckpt, lambda e: e["optimizer"].pop("t"))
    rewrite_optim(ckpt, lambda a: a.__setitem__("optimizer/t", np.zeros(1, np.int64)))
    rejects(ckpt, OPTIM, "has unexpected ['optimizer/t']")
    run, tree = fresh(ckpt.parent.parent), CheckpointDir(ckpt).load().state
    with pytest.raises(StateMismatch) as info:
        check(run.parts, tree)
    assert info.value.path == ("t",) and "expected int, got array" in info.value.reason
    assert files_of(info.value, tree, capture(run.parts)) == f"{OPTIM} and {EXTRA}"


def test_the_directory_name_says_which_step_lies(ckpt, tmp_path):
    """manifest.json's step, extra.json's progress.step and the directory's name: the odd one out is named."""
    m = manifest_of(ckpt)
    write_manifest(ckpt, {**m, "step": 11})
    rejects(
        ckpt,
        MANIFEST,
        "step 11 differs from progress.step 10 of extra.json and the directory's name",
    )
    loose = tmp_path / "elsewhere" / "mine"  # no step in its name: no third witness, both named
    loose.parent.mkdir()
    os.rename(ckpt, loose)
    error = rejects(
        loose, f"{MANIFEST} and {EXTRA}", "the manifest's step 11 and progress.step 10 differ"
    )
    assert "directory's name" not in error.reason


@pytest.mark.parametrize("saved_step, step", [(True, 1), (10.0, 10)], ids=["bool", "float"])
def test_a_progress_step_that_is_no_integer_is_refused(ckpt, saved_step, step):
    """JSON true equals 1 and 10.0 equals 10 in Python; neither is the integer step the manifest and the name say."""
    directory = ckpt.with_name(step_dir_name(step))
    os.rename(ckpt, directory)
    write_manifest(directory, {**manifest_of(directory), "step": step})
    edit_extra(directory, lambda e: e["progress"].__setitem__("step", saved_step))
    with pytest.raises(CheckpointError) as info:
        CheckpointDir(directory).load()
    assert (info.value.file, info.value.reason) == (
        EXTRA,
        f"progress.step {saved_step!r} differs from step {step} of manifest.json and the directory's name",
    )


def test_a_renamed_step_directory_is_refused(ckpt):
    renamed = ckpt.with_name(step_dir_name(12))
    os.rename(ckpt, renamed)
    with pytest.raises(CheckpointError) as info:
        CheckpointDir(renamed).load()
    assert str(info.value) == (
        f"checkpoint {renamed}: its name says step 12, but manifest.json and extra.json "
        "say step 10 (renamed or copied in from another step)"
    )


# -- links: no reader follows one out of a run --------------------------------------------------------


def refused_link(path: Path, *words: str) -> str:
    """Every reader refuses `path` with one line (read_manifest, load, json_state: what every tool opens)."""
    messages = set()
    for read in (
        CheckpointDir.manifest,
        CheckpointDir.load,
        CheckpointDir.resolved,
        CheckpointDir.json_state,
    ):
        with pytest.raises(CheckpointError) as info:
            read(CheckpointDir(path))
        messages.add(str(info.value))
    (message,) = messages
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def test_a_run_link_names_a_step_directory_beside_it(ckpt, tmp_path):
    root = ckpt.parent
    os.symlink(ckpt.name, root / "best")
    assert CheckpointDir(root / "best").resolved() == ckpt
    assert (
        CheckpointDir(root / "best").load().directory == root / "best"
        and CheckpointDir(root / "best").load().manifest["step"] == 10
    )
    outside = tmp_path / "outside" / ckpt.name  # a valid checkpoint: only the link is wrong
    outside.parent.mkdir()
    shutil.copytree(ckpt, outside)
    for name, target in (
        ("final", str(outside)),
        ("up", f"../outside/{ckpt.name}"),
        (step_dir_name(6), ckpt.name),
    ):
        os.symlink(target, root / name)
        message = refused_link(
            root / name,
            f"checkpoint {root / name}: is a symlink to {target!r}",
            "out of its run's checkpoints/",
            "remove it",
        )
        if name == step_dir_name(6):
            assert "a step directory must be a directory, not a link" in message
        (root / name).unlink()


def test_a_users_own_link_is_followed_but_not_out_of_a_run(ckpt, tmp_path):
    root = ckpt.parent
    mine = tmp_path / "mine"
    os.symlink(
        ckpt, mine
    )  # the user's own link, outside any checkpoints/: as if they typed its target
    assert (
        CheckpointDir(mine).resolved() == ckpt and CheckpointDir(mine).load().manifest["step"] == 10
    )
    os.symlink(ckpt.name, root / "best")
    mine.unlink()
    os.symlink(root / "best", mine)  # through a run's link that obeys the rule
    assert CheckpointDir(mine).resolved() == ckpt
    os.symlink(str(tmp_path), root / "evil")
    mine.unlink()
    os.symlink(root / "evil", mine)  # through a run's link that does not
    refused_link(
        mine,
        f"checkpoint {root / 'evil'}: is a symlink to {str(tmp_path)!r} (reached through {mine})",
    )


def test_a_run_link_typed_inside_checkpoints_is_still_a_run_link(ckpt, tmp_path, monkeypatch):
    os.symlink(str(tmp_path), ckpt.parent / "best")
    monkeypatch.chdir(ckpt.parent)
    refused_link(
        Path("best"), f"checkpoint {ckpt.parent / 'best'}: is a symlink to {str(tmp_path)!r}"
    )
    assert CheckpointDir(Path(ckpt.name)).resolved() == Path(
        ckpt.name
    )  # no link: the path as given


def test_a_checkpoints_directory_that_is_a_link_is_refused(ckpt, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(ckpt.parent, run / "checkpoints")
    refused_link(
        run / "checkpoints" / ckpt.name,
        f"{run / 'checkpoints'} is a symlink to {str(ckpt.parent)!r}",
        "must be a directory inside it",
    )


def test_a_cycle_of_links_is_refused(tmp_path):
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    refused_link(tmp_path / "a", "more than 8 symlinks")


# -- what other readers take from inside checkpoints/: through the store, verified -------------------------


def test_json_state_is_the_manifest_and_extra_json_as_written(saved):
    manifest, extra = CheckpointDir(saved).json_state()
    assert manifest == manifest_of(saved) and extra == json.loads(
        (saved / EXTRA).read_text()
    )  # the files' own
    loaded = CheckpointDir(saved).load().state
    assert extra["stages"] == loaded["stages"] and extra["progress"] == loaded["progress"]


def not_an_object(directory: Path) -> None:
    (directory / EXTRA).write_text("[]")
    relist(directory, EXTRA)


@pytest.mark.parametrize(
    "damage, file, words",
    [
        (lambda d: flip_bit(d / EXTRA, 40), EXTRA, [CORRUPTED]),  # edited without relisting
        (not_an_object, EXTRA, ["not a JSON object"]),
        (lambda d: (d / EXTRA).unlink(), EXTRA, ["listed in manifest.json but missing"]),
        (lambda d: (d / "stray").write_text("x"), "stray", ["present but not listed"]),
        (lambda d: (d / MANIFEST).unlink(), MANIFEST, ["missing"]),
    ],
)
def test_json_state_refuses_what_load_refuses_naming_the_file(ckpt, damage, file, words):
    damage(ckpt)
    for read in (CheckpointDir.json_state, CheckpointDir.load):
        with pytest.raises(CheckpointError) as info:
            read(CheckpointDir(ckpt))
        assert info.value.file == file and all(w in info.value.reason for w in words), str(
            info.value
        )


def test_newest_manifest_is_the_newest_steps_and_a_bad_one_is_none(saved, tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.newest_manifest() is None  # no store yet
    for step in (4, 10):
        shutil.copytree(saved, store.root / step_dir_name(step))
    os.symlink(step_dir_name(4), store.root / "best")  # links are not steps
    assert store.newest_manifest() == (store.root / step_dir_name(10), manifest_of(saved))
    (store.root / step_dir_name(10) / MANIFEST).write_text("{")
    assert (
        store.newest_manifest() is None
    )  # the newest is what is asked about: no older one instead
    (store.root / "stray").write_text("x")
    with pytest.raises(OSError, match="not a checkpoint step directory"):
        store.newest_manifest()
