"""`python -m pipeline.roundtrip`: lab 02's checks as a command, its results file, and that it can fail."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY

from pipeline.checkpoint.directory import WEIGHTS, CheckpointDir
from pipeline.checkpoint.manifest import SCHEMA_VERSION
from pipeline.cli import roundtrip
from pipeline.stateful import PARTS

SEED_FIELDS = {
    "byte_equivalent_state_machines": list,
    "all_byte_equal": bool,
    "continuation_test_passed": bool,
    "weight_tying_preserved": (bool, type(None)),
    "atomic_write_resilient": bool,
    "weights_file_size_bytes": int,
    "expected_size_bytes_no_tying": int,
    "size_delta_pct": float,
    "manifest_schema_version": str,
}


def test_kernodeck_passes_and_writes_the_seed_fields(tmp_path, cli):
    proc = cli(
        "experiment=kernodeck", f"paths.output_dir={tmp_path / 'out'}", module="pipeline.roundtrip"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert (
        path.name == "roundtrip_results.json"
        and path.parent.parent == tmp_path / "out" / "roundtrip"
    )
    r = json.loads(path.read_text())
    for field, kind in SEED_FIELDS.items():
        assert isinstance(r[field], kind), (field, r[field])
    assert r["byte_equivalent_state_machines"] == list(PARTS)
    assert (
        r["all_byte_equal"]
        and r["continuation_test_passed"]
        and r["atomic_write_resilient"]
        and r["passed"]
    )
    assert r["continuation"]["separate_process"] is True
    assert r["weight_tying_preserved"] is None and r["weight_tying_note"].startswith(
        "no tied weights in this model"
    )
    printed = dict(line.split(": ", 1) for line in proc.stdout.splitlines()[:-1])
    assert (
        printed["weight_tying_preserved"] == f"null  # {r['weight_tying_note']}"
    )  # why null, beside PASS
    head = r["weights_header_bytes"]
    assert printed["size_delta_pct"] == (
        f"{r['size_delta_pct']}  # relative to the unique parameters' 264 bytes (a tied array counted once): "
        f"the weights file has {264 + head}, +{head} bytes, all {head} of them its safetensors header"
    )
    assert r["size_delta_note"] == printed["size_delta_pct"].split("  # ", 1)[1]
    assert r["expected_size_bytes_no_tying"] == 33 * 8  # seed 003's 33 float64 parameters
    assert r["weights_file_size_bytes"] == (Path(r["checkpoint"]) / WEIGHTS).stat().st_size
    assert (
        r["weights_file_size_bytes"] - r["expected_size_bytes_no_tying"]
        == r["weights_header_bytes"]
    )
    assert r["manifest_schema_version"] == SCHEMA_VERSION
    assert json.loads((path.parent / "manifest.json").read_text())["step"] == 10
    CheckpointDir(Path(r["checkpoint"])).load()
    assert r["atomic"]["checks"]["interrupted"] and r["atomic"]["checks"]["temporary_left"]
    assert not list((tmp_path / "cwd").iterdir())  # nothing written to the working directory
    assert [
        p.name for p in path.parent.iterdir() if p.name.startswith(".")
    ] == []  # scratch removed


def test_tied_minigpt_passes(tmp_path):
    overrides = [*TINY, "model.dropout=0.1", f"paths.output_dir={tmp_path}"]
    r, _path = roundtrip.roundtrip(overrides, steps=5, separate_process=False)
    assert r["passed"] and r["weight_tying_preserved"] is True, r
    assert r["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert abs(r["weights_file_size_bytes"] - r["expected_size_bytes_no_tying"]) < 4096
    assert "weight_tying_note" not in r and r["size_delta_note"].startswith(
        f"relative to the unique parameters' {r['expected_size_bytes_no_tying']} bytes (a tied array counted once)"
    )


def test_a_restore_that_forgets_the_rng_fails(tmp_path, monkeypatch):
    """The negative control: the checks can fail, and name what failed."""
    import pipeline.stateful
    import pipeline.verify.worker

    real_restore = pipeline.stateful.restore
    monkeypatch.setattr(
        pipeline.verify.worker,
        "restore",
        lambda parts, tree, only=PARTS: real_restore(
            parts, tree, tuple(m for m in only if m != "rng")
        ),
    )
    code = roundtrip.main(["--in-process", "experiment=kernodeck", f"paths.output_dir={tmp_path}"])
    assert code == 1
    r = json.loads(next((tmp_path / "roundtrip").glob("*/roundtrip_results.json")).read_text())
    assert r["byte_equivalent_state_machines"] == [p for p in PARTS if p != "rng"]
    assert not r["all_byte_equal"] and "rng" in r["state_differences"]
    assert not r["continuation_test_passed"] and "losses" in r["continuation"]["differences"]
    assert (
        "state" in r["continuation"]["differences"]
    )  # the continuation compares every part, rng included
    assert not r["passed"]


def test_bad_override_exits_2(tmp_path, capsys):
    assert roundtrip.main(["optimizer.lr=abc", f"paths.output_dir={tmp_path}"]) == 2
    assert "optimizer.lr" in capsys.readouterr().err
    assert not (tmp_path / "roundtrip").exists()
