"""`python -m pipeline` end to end, as a subprocess started from an empty temporary cwd."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # tests/ -> the project root
KEYS = {"step", "epoch", "time", "train/loss", "lr", "grad_norm"}
GROUPS = ("model", "optimizer", "scheduler", "data", "trainer", "experiment")


def metrics_files(output_dir: Path) -> list[Path]:
    return sorted(Path(output_dir).rglob("metrics.jsonl"))


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_time(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "time"} for line in lines]


@pytest.fixture(scope="module")
def kernodeck_runs(pipeline_runner, tmp_path_factory):
    """Two runs of experiment=kernodeck, same seed, different output dirs and cwds."""
    runs = []
    for i in range(2):
        root = tmp_path_factory.mktemp(f"kernodeck{i}")
        out, cwd = root / "out", root / "cwd"
        proc = pipeline_runner(["experiment=kernodeck", f"paths.output_dir={out}"], cwd=cwd)
        runs.append((proc, out, cwd))
    return runs


def test_kernodeck_run_writes_ten_metric_lines(kernodeck_runs):
    proc, out, cwd = kernodeck_runs[0]
    assert proc.returncode == 0, proc.stderr
    files = metrics_files(out)
    assert len(files) == 1
    path = files[0]
    assert path.parent.parent == out / "runs" and path.parent.name.startswith("kernodeck")
    lines = read_lines(path)
    assert len(lines) == 10
    assert [line["step"] for line in lines] == list(range(1, 11))
    assert [line["lr"] for line in lines] == pytest.approx(
        [0.03] * 3 + [0.015] * 3 + [0.0075] * 3 + [0.00375], rel=1e-12, abs=0)
    for line in lines:
        assert KEYS <= set(line), line
        assert math.isfinite(line["train/loss"]) and line["grad_norm"] > 0
    assert [line["epoch"] for line in lines] == [0] * 6 + [1] * 4
    assert "val/loss" in lines[4] and "val/loss" in lines[9]  # eval_every 5
    assert list(cwd.iterdir()) == []  # nothing written relative to the cwd


def test_same_seed_gives_identical_metrics_apart_from_time(kernodeck_runs):
    (p1, out1, _), (p2, out2, _) = kernodeck_runs
    assert p1.returncode == 0 and p2.returncode == 0
    a, b = read_lines(metrics_files(out1)[0]), read_lines(metrics_files(out2)[0])
    assert without_time(a) == without_time(b)
    assert len(a) == 10


def test_metrics_match_an_in_process_run(kernodeck_runs, compose_cfg, tmp_path):
    """The CLI trains exactly what build_state + train_step compute (the seed, lr and data order)."""
    from pipeline.build import build_state
    from pipeline.trainer.loop import train_step

    state = build_state(compose_cfg("experiment=kernodeck", f"paths.output_dir={tmp_path}"))
    records = [train_step(state) for _ in range(10)]
    lines = read_lines(metrics_files(kernodeck_runs[0][1])[0])
    for r, line in zip(records, lines):
        assert (line["step"], line["epoch"], line["lr"]) == (r["step"], r["epoch"], r["lr"])
        assert line["train/loss"] == pytest.approx(r["train/loss"], rel=1e-12)
        assert line["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-12)


@pytest.mark.parametrize("override,key", [
    ("optimizer.lr=abc", "optimizer.lr"),
    ("model.nonexistent=1", "model.nonexistent"),
])
def test_bad_override_fails_naming_the_key(cli, tmp_path, override, key):
    out = tmp_path / "out"
    proc = cli("experiment=kernodeck", override, f"paths.output_dir={out}")
    assert proc.returncode != 0
    assert key in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr  # a message, not a stack trace (HYDRA_FULL_ERROR unset)
    assert metrics_files(tmp_path) == []


def test_cfg_job_prints_the_composed_config(cli, compose_cfg, tmp_path):
    overrides = ["experiment=kernodeck", "optimizer.lr=0.05", f"paths.output_dir={tmp_path / 'out'}"]
    proc = cli("--cfg", "job", *overrides)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.to_container(OmegaConf.create(proc.stdout), resolve=False)
    expected = OmegaConf.to_container(compose_cfg(*overrides), resolve=False, enum_to_str=True)
    assert printed == expected
    assert printed["optimizer"]["lr"] == 0.05 and printed["name"] == "kernodeck"
    assert printed["paths"]["output_dir"] == str(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # printing the config runs nothing


def test_help_lists_the_config_groups(cli, tmp_path):
    proc = cli("--help", f"paths.output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr
    assert "== Configuration groups ==" in proc.stdout
    listed = {line.split(":", 1)[0] for line in proc.stdout.splitlines() if ":" in line and not line.startswith(" ")}
    assert set(GROUPS) <= listed, listed
    assert "optimizer: adam, adamw, sgd" in proc.stdout
    assert "scheduler: constant, cosine, step" in proc.stdout
    assert "experiment: kernodeck" in proc.stdout
    assert not (tmp_path / "out").exists()


def hf_cosine_with_warmup(base_lr, step, warmup, total):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def test_sgd_cosine_200_steps(cli, tmp_path):
    out = tmp_path / "out"
    proc = cli("optimizer=sgd", "optimizer.lr=0.1", "scheduler=cosine", "trainer.max_steps=200", "tracking=none",
               f"paths.output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    (path,) = metrics_files(out)
    lines = read_lines(path)
    assert lines[-1]["step"] == 200
    # conf/scheduler/cosine.yaml: 100 warmup steps, total = the run's 200 updates
    for line in lines:
        assert line["lr"] == pytest.approx(hf_cosine_with_warmup(0.1, line["step"] - 1, 100, 200), rel=1e-12, abs=1e-18)
    assert list((tmp_path / "cwd").iterdir()) == []


def test_default_output_dir_is_the_project_outputs_whatever_the_cwd(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg(return_hydra_config=True)
    assert cfg.paths.output_dir == str(PROJECT_ROOT / "outputs")
    assert cfg.paths.runs_dir == str(PROJECT_ROOT / "outputs" / "runs")
    assert Path(cfg.hydra.run.dir).parent == PROJECT_ROOT / "outputs" / "runs"


def test_default_output_dir_printed_by_the_cli_from_another_cwd(cli, tmp_path):
    proc = cli("--cfg", "job", "--resolve", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.paths.output_dir == str(PROJECT_ROOT / "outputs")
    assert list((tmp_path / "elsewhere").iterdir()) == []
