"""A text run's data at scale: a resume mid-epoch bit-exact with fixed windows and with sampling at every offset
(on another thread count), a checkpoint whose size does not grow with the text, and a checkpoint in afe8033's
form (the iterator's permutation in optim.safetensors) resumed bit-exact."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import kept, metrics, run_job, text_overrides, the_run
from safetensors.numpy import load_file, save_file

from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.data.iterator import restore_stream
from pipeline.run.signals import SIGNALS_STATE

ALPHABET = "abcdefghij klmnop\nqrstuvwxyz.,;é☕"  # every character in every text: one vocabulary


def write_text(path: Path, size: int, seed: int = 0) -> Path:
    """About `size` bytes of UTF-8 made of ALPHABET, every character present."""
    chars = np.array(list(ALPHABET))
    text = ALPHABET + "".join(chars[np.random.default_rng(seed).integers(0, len(chars), size)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode()[:size].decode(errors="ignore").encode())
    return path


def overrides(path: Path, *extra: str) -> tuple[str, ...]:
    return (
        *text_overrides(path),
        "trainer.max_steps=12",
        "trainer.eval_every=4",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=3",
        *extra,
    )


def interrupted_then_resumed(args: tuple[str, ...], out: Path, preempt_at, k: int) -> Path:
    preempt_at(k)
    assert run_job(*args, "trainer.threads=1", f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*args, "trainer.threads=2", f"paths.output_dir={out}")[0] == 0
    return the_run(out)


@pytest.mark.parametrize("every_offset", ["false", "true"])
def test_a_text_run_resumes_mid_epoch_bit_exact(tmp_path, preempt_at, every_offset):
    text = write_text(tmp_path / "t.txt", 20_000)
    args = overrides(text, f"data.every_offset={every_offset}")
    ref = tmp_path / "ref"
    assert run_job(*args, "trainer.threads=2", f"paths.output_dir={ref}")[0] == 0
    run = interrupted_then_resumed(args, tmp_path / "out", preempt_at, 5)
    extra = json.loads((run / "checkpoints" / "step-00000006" / "extra.json").read_text())
    assert extra["data_iter"]["epoch"] == 0 and extra["data_iter"]["cursor"] > 0  # mid-epoch
    assert kept(run) == kept(the_run(ref)) and metrics(run) == metrics(the_run(ref))


def test_every_offset_samples_windows_at_any_offset(tmp_path):
    from conftest import config_of

    from pipeline.run.assemble import build_dataset, build_state

    text = write_text(tmp_path / "t.txt", 20_000)
    config = config_of(*overrides(text, "data.every_offset=true"), f"paths.output_dir={tmp_path}")
    data = build_dataset(config)
    state = build_state(config, data.spec, data.n_train, data)
    try:
        T, train = data.spec.block_size, np.asarray(data.tokens["train"])
        assert data.n_offsets == len(train) - T and state.iterator.n == data.n_train
        ids = np.concatenate([state.iterator.next_ids() for _ in range(50)])
        assert (
            ids % T != 0
        ).any() and ids.max() < data.n_offsets  # not only the fixed windows' starts
        batch = data.train_batch(ids[:4])
        for i, start in enumerate(ids[:4]):  # the window at that offset, its targets one token on
            np.testing.assert_array_equal(batch.x[i], train[start : start + T])
            np.testing.assert_array_equal(batch.y[i], train[start + 1 : start + T + 1])
    finally:
        state.runner.close()


def zeroed(v):
    """A JSON value with every number (and every decimal string: an RNG's 128-bit state) written as 0."""
    if isinstance(v, dict):
        return {k: zeroed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [zeroed(x) for x in v]
    numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
    return 0 if numeric or (isinstance(v, str) and v.isdigit()) else v


def sizes(checkpoint: Path) -> dict[str, int]:
    """Each file's size; a JSON file's with its numbers zeroed (a loss's or a count's digits vary in number)."""
    return {
        p.name: len(json.dumps(zeroed(json.loads(p.read_bytes()))))
        if p.suffix == ".json"
        else p.stat().st_size
        for p in sorted(checkpoint.iterdir())
    }


def test_a_checkpoint_is_the_same_size_whatever_the_text_size(tmp_path):
    runs = {}
    for size in (1 << 20, 4 << 20):
        text = write_text(tmp_path / str(size) / "t.txt", size, seed=size)
        args = overrides(text, "trainer.max_steps=2", "data.max_bytes=8388608")
        out = tmp_path / str(size) / "out"
        assert run_job(*args, f"paths.output_dir={out}")[0] == 0
        runs[size] = sizes(the_run(out) / "checkpoints" / "step-00000002")
        extra = json.loads(
            (the_run(out) / "checkpoints" / "step-00000002" / "extra.json").read_text()
        )
        assert set(extra["data_iter"]) == {"epoch", "cursor", "start"}
    assert runs[1 << 20] == runs[4 << 20]


def relist(directory: Path, name: str) -> None:
    m = json.loads((directory / "manifest.json").read_text())
    raw = (directory / name).read_bytes()
    m["files"][name] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(m))


def as_afe8033(checkpoint: Path) -> None:
    """The checkpoint rewritten as afe8033 wrote it: its iterator's permutation in optim.safetensors, no start."""
    extra = json.loads((checkpoint / "extra.json").read_text())
    state = extra["data_iter"]
    g = np.random.Generator(np.random.PCG64())
    restore_stream(g, state.pop("start"))
    arrays = load_file(str(checkpoint / "optim.safetensors"))
    n = json.loads((checkpoint / "manifest.json").read_text())["data_spec"]["n_train"]
    arrays["data_iter/permutation"] = g.permutation(n).astype(np.int64)
    save_file(arrays, str(checkpoint / "optim.safetensors"), metadata={"format": "np"})
    (checkpoint / "extra.json").write_text(json.dumps(extra))
    relist(checkpoint, "optim.safetensors")
    relist(checkpoint, "extra.json")


def test_a_checkpoint_in_afe8033s_form_resumes_bit_exact(tmp_path, preempt_at):
    text = write_text(
        tmp_path / "t.txt", 1_500
    )  # 42 batches an epoch: the second begins at step 43
    args = overrides(text, "trainer.max_steps=50")
    ref = tmp_path / "ref"
    assert run_job(*args, f"paths.output_dir={ref}")[0] == 0
    out = tmp_path / "out"
    preempt_at(7)
    assert run_job(*args, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    for checkpoint in (the_run(out) / "checkpoints").glob("step-*"):
        as_afe8033(checkpoint)
    assert run_job(*args, f"paths.output_dir={out}")[0] == 0
    assert not (the_run(out) / "superseded").exists()  # resumed from step 7, not started afresh
    assert metrics(the_run(out)) == metrics(the_run(ref))
    ours, theirs = kept(the_run(out)), kept(the_run(ref))
    assert ours[1] == theirs[1] and set(ours[0]) == set(
        theirs[0]
    )  # the same steps kept, the same links
    for step, files in ours[0].items():
        if (
            step < 43
        ):  # the first epoch's state is saved as it came: its permutation, which cannot be redrawn
            assert files["weights.safetensors"] == theirs[0][step]["weights.safetensors"]
        else:  # the second epoch began in this code: today's form, every byte equal
            assert files == theirs[0][step]


@pytest.mark.slow
@pytest.mark.parametrize("every_offset", ["true", "false"])
def test_the_verifier_on_nanogpts_recipe_is_exact_and_its_negative_control_diverges(
    tmp_path, every_offset
):
    """With every_offset the batches after the cut draw from data_order, so a resume without the RNG goes
    elsewhere; fixed windows (dropout 0, the epoch's order drawn at its start) give it nothing to differ by
    (the dropout stream moves, its draws unused: "did not diverge although streams moved")."""
    import subprocess
    import sys

    from conftest import env_for_subprocess

    text = write_text(tmp_path / "t.txt", 20_000)
    args = ["experiment=nanogpt_char_cpu", f"data.path={text}", f"data.every_offset={every_offset}"]
    args += ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "tracking=none"]
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.verify", *args, f"paths.output_dir={out}"],
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    (path,) = (out / "verify").glob("*/verification.json")
    report = json.loads(path.read_text())
    assert report["positive"] is True, r.stdout
    if every_offset == "true":
        assert r.returncode == 0 and report["negative_divergence_detected"] is True, r.stdout
    else:
        assert r.returncode == 1 and report["negative_divergence_detected"] is False, r.stdout
