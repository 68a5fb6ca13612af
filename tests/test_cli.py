"""`python -m pipeline` end to end, as a subprocess from an empty temporary cwd: what a user sees, exit codes,
signals from start-up to the last save, and a busy run directory left untouched."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    KERNODECK,
    PROJECT_ROOT,
    TINY,
    Proc,
    compose,
    env_for_subprocess,
    the_run,
    wait_until,
)
from omegaconf import OmegaConf

from pipeline.checkpoint.directory import CheckpointDir
from pipeline.run.directory import RunDir
from pipeline.run.signals import SIGNALS

KEYS = {"step", "epoch", "time", "train/loss", "lr", "grad_norm"}
GROUPS = ("model", "optimizer", "scheduler", "data", "trainer", "experiment", "stages", "tracking")


def lines_of(out: Path) -> list[dict]:
    return RunDir(the_run(out)).read_metrics()


def without_time(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "time"} for line in lines]


@pytest.fixture(scope="module")
def kernodeck_by_the_cli(tmp_path_factory, pipeline_runner) -> tuple:
    """(the finished process, its output directory, its cwd): `python -m pipeline` on kernodeck once for the
    module, read by every test that asks."""
    tmp = tmp_path_factory.mktemp("cli")
    proc = pipeline_runner([*KERNODECK, f"paths.output_dir={tmp / 'out'}"], cwd=tmp / "cwd")
    return proc, tmp / "out", tmp / "cwd"


def test_kernodeck_run_writes_ten_metric_lines_and_nothing_in_the_cwd(kernodeck_by_the_cli):
    proc, out, cwd = kernodeck_by_the_cli
    assert proc.returncode == 0, proc.stderr
    assert f"run directory: {the_run(out)}" in proc.stdout and "starting a new run" in proc.stdout
    lines = lines_of(out)
    assert [line["step"] for line in lines] == list(range(1, 11))
    assert [line["lr"] for line in lines] == pytest.approx(
        [0.03] * 3 + [0.015] * 3 + [0.0075] * 3 + [0.00375], rel=1e-12, abs=0
    )
    for line in lines:
        assert set(line) >= KEYS, line
        assert math.isfinite(line["train/loss"]) and line["grad_norm"] > 0
    assert [line["epoch"] for line in lines] == [0] * 6 + [1] * 4
    assert "val/loss" in lines[4] and "val/loss" in lines[9]  # eval_every 5
    assert list(cwd.iterdir()) == []  # nothing written relative to the cwd
    run = the_run(out)
    assert (run / ".hydra" / "config.yaml").is_file() and "kernodeck" in (
        run / "pipeline.log"
    ).read_text()


def test_the_cli_trains_what_the_job_computes(kernodeck_by_the_cli, tmp_path):
    """The same seed, lr and data order as build + train_step in this process."""
    from conftest import config_of

    from pipeline.run.job import build
    from pipeline.trainer.loop import train_step

    proc, out, _ = kernodeck_by_the_cli
    assert proc.returncode == 0
    state = build(config_of(*KERNODECK, f"paths.output_dir={tmp_path / 'other'}")).state
    records = [train_step(state) for _ in range(10)]
    for r, line in zip(records, lines_of(out)):
        assert (line["step"], line["epoch"], line["lr"], line["train/loss"], line["grad_norm"]) == (
            r["step"],
            r["epoch"],
            r["lr"],
            r["train/loss"],
            r["grad_norm"],
        )


@pytest.mark.parametrize(
    "override,key",
    [
        ("optimizer.lr=abc", "optimizer.lr"),
        ("model.nonexistent=1", "model.nonexistent"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("trainer.batch_size=0", "trainer.batch_size"),
        ("stages.best_val.mode=maximum", "mode"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_run_directory(cli, tmp_path, override, key):
    out = tmp_path / "out"
    proc = cli(*KERNODECK, override, f"paths.output_dir={out}")
    assert proc.returncode != 0, proc.stderr
    assert key in proc.stderr + proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr  # a message, not a stack trace (HYDRA_FULL_ERROR unset)
    assert not (out / "runs").exists()


def test_cfg_job_prints_the_composed_config(cli, tmp_path):
    overrides = [
        "experiment=kernodeck",
        "optimizer.lr=0.05",
        f"paths.output_dir={tmp_path / 'out'}",
    ]
    proc = cli("--cfg", "job", *overrides)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.to_container(OmegaConf.create(proc.stdout), resolve=False)
    expected = OmegaConf.to_container(compose(*overrides), resolve=False, enum_to_str=True)
    assert printed == expected
    assert printed["optimizer"]["lr"] == 0.05 and printed["name"] == "kernodeck"
    assert printed["paths"]["output_dir"] == str(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # printing the config runs nothing


def test_help_lists_the_config_groups(cli, tmp_path):
    proc = cli("--help", f"paths.output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr
    listed = {
        line.split(":", 1)[0]
        for line in proc.stdout.splitlines()
        if ":" in line and not line.startswith(" ")
    }
    assert set(GROUPS) <= listed, listed
    assert "optimizer: adam, adamw, sgd" in proc.stdout
    assert "experiment: kernodeck" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_hydra_mode_is_composed_for_only_where_something_can_set_it(tmp_path):
    """The start skips Hydra's first composition (it only reads hydra.mode) unless an override, another config
    directory or a config file of the tree can set hydra.mode."""
    from pipeline.__main__ import mode_is_the_command_lines

    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "config.yaml").write_text(
        "stages:\n  best_val:\n    mode: min\n"
    )  # a monitor's mode is not Hydra's
    assert mode_is_the_command_lines(["-m", "optimizer.lr=0.1,0.2"], conf)
    for argv in (
        ["hydra.mode=MULTIRUN"],
        ["--config-dir", "x"],
        ["-cd=x"],
        ["--config-name=other"],
        ["hydra.searchpath=[file://x]"],
    ):
        assert not mode_is_the_command_lines(argv, conf), argv
    fifo = conf / "experiment" / "fifo.yaml"
    os.mkfifo(fifo)  # never opened: what cannot be read as a file is left to Hydra
    assert not mode_is_the_command_lines([], conf)
    fifo.unlink()
    (conf / "experiment" / "grid.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n"
    )
    assert not mode_is_the_command_lines([], conf)


HYDRA_METHODS = (
    "from hydra._internal.hydra import Hydra\n"
    "from hydra._internal.config_loader_impl import ConfigLoaderImpl\n"
    "def methods():\n"
    "    return Hydra.__dict__['get_mode'], ConfigLoaderImpl.__dict__['get_group_options']\n"
)


@pytest.mark.parametrize("argv", [["--help"], [*KERNODECK, "tracking=none"]], ids=["help", "job"])
def test_the_entrys_hydra_shortcuts_last_only_as_long_as_its_call(argv, tmp_path):
    """The entry replaces Hydra's get_mode (and, for --help, get_group_options) around its one call to Hydra:
    during it they are its own, after it returns they are Hydra's again (no process-wide change outlives it)."""
    args = ["pipeline", *argv] + (
        [] if argv == ["--help"] else [f"paths.output_dir={tmp_path / 'out'}"]
    )
    code = (
        HYDRA_METHODS + "import json, sys\n"
        "import pipeline.__main__ as m\n"
        "import pipeline.run.job as app\n"
        "original, during = methods(), []\n"
        # the job: only where Hydra is then
        "app.main = lambda *a, **k: during.append(methods()) or app.Outcome('complete', 0)\n"
        f"sys.argv = {args!r}\n"
        "try:\n"
        "    m.main()\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(json.dumps([methods() == original, [d[0] is original[0] for d in during]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored, replaced_during = json.loads(proc.stdout.strip().splitlines()[-1])
    assert restored is True
    if argv != ["--help"]:
        assert replaced_during == [False]  # the job ran while get_mode was the entry's own


def test_hydra_mode_multirun_as_an_override_still_sweeps(cli, tmp_path):
    out = tmp_path / "out"
    proc = cli(
        "hydra.mode=MULTIRUN", *KERNODECK, "optimizer.lr=0.01,0.02", f"paths.output_dir={out}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((out / "runs").iterdir())) == 2 and len(list((out / "sweeps").iterdir())) == 1


def hf_cosine_with_warmup(base_lr, step, warmup, total):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def test_sgd_cosine_schedule(cli, tmp_path):
    out = tmp_path / "out"
    proc = cli(
        *TINY,
        "optimizer=sgd",
        "optimizer.lr=0.1",
        "scheduler=cosine",
        "scheduler.warmup_steps=5",
        "trainer.max_steps=20",
        f"paths.output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr
    lines = lines_of(out)
    assert lines[-1]["step"] == 20
    for line in lines:
        assert line["lr"] == pytest.approx(
            hf_cosine_with_warmup(0.1, line["step"] - 1, 5, 20), rel=1e-12, abs=1e-18
        )


def test_default_output_dir_is_the_checkouts_outputs_whatever_the_cwd(cli, tmp_path):
    proc = cli("--cfg", "job", "--resolve", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.paths.output_dir == str(PROJECT_ROOT / "outputs")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# -- signals ------------------------------------------------------------------------------------------

LONG = (
    *KERNODECK,
    "trainer.max_steps=200000",
    "trainer.log_every=100",
    "trainer.eval_every=50000",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=100000",
)


def steps_logged(out: Path) -> int:
    runs = list((out / "runs").glob("*/metrics.jsonl")) if (out / "runs").exists() else []
    lines = RunDir(runs[0].parent).read_metrics() if runs else []
    return lines[-1]["step"] if lines else 0


def catches(pid: int, sig: int) -> bool:
    """True once the process has a handler for `sig` (the entry point's first instruction installs it)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_during_start_up_exits_75_in_one_line(tmp_path, sig):
    """From the first instruction of the entry point: a signal before training is never a traceback."""
    for delay in (0.0, 0.3, 1.0):  # while importing, composing, building (a new run each time)
        # long enough never to finish first: a signal after the last instruction finds Python's default handlers
        proc = Proc(
            [*TINY, "trainer.max_steps=5000", f"paths.output_dir={tmp_path / str(delay)}"],
            tmp_path / "cwd",
        )
        wait_until(
            lambda proc=proc: all(catches(proc.p.pid, s) for s in SIGNALS),
            "the entry point's handlers",
            proc,
        )
        time.sleep(delay)
        proc.send_signal(sig)
        code = proc.wait()
        assert code == 75, (delay, proc.stderr)
        assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, (
            proc.stderr
        )


@pytest.mark.parametrize("raised", ["Interrupted(15)", "ValueError('a bug')"])
def test_a_signal_raised_inside_a_callback_python_runs_itself_is_no_traceback(tmp_path, raised):
    # a signal can land in a weakref's callback inside the import system, where no exception propagates (Python
    # prints "Exception ignored"): an interruption is held by the signal state, and only other errors are printed
    code = (
        "import weakref\nfrom pipeline.run.signals import SIGNALS_STATE, Interrupted\nSIGNALS_STATE.install()\n"
        f"class A: pass\na = A()\ndef cb(ref): raise {raised}\nr = weakref.ref(a, cb)\ndel a\nprint('on')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout == "on\n"
    assert ("Traceback" in proc.stderr) == raised.startswith("ValueError"), proc.stderr


@pytest.mark.slow
def test_sigterm_then_sigint_during_training_still_saves_and_exits_75(tmp_path):
    out = tmp_path / "out"
    proc = Proc([*LONG, f"paths.output_dir={out}"], tmp_path / "cwd")
    wait_until(lambda: steps_logged(out) >= 200, "step 200", proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(
        signal.SIGINT
    )  # a second signal changes nothing: the save in progress completes
    assert proc.wait() == 75, proc.stderr
    assert "Traceback" not in proc.stderr
    run = the_run(out)
    status = RunDir(run).read_status()
    assert status["status"] == "preempted"
    newest = RunDir(run).store.steps()[-1]
    assert newest[0] == status["step"] >= 200
    CheckpointDir(newest[1]).load()


@pytest.mark.slow
def test_a_refused_process_changes_nothing_in_the_busy_run(tmp_path):
    """Regression (#12.6): the refused process rewrote .hydra/config.yaml and overrides.yaml."""
    out = tmp_path / "out"
    first = Proc([*LONG, f"paths.output_dir={out}"], tmp_path / "cwd")
    try:
        wait_until(lambda: steps_logged(out) >= 200, "step 200", first)
        run = the_run(out)
        watched = [
            run / ".hydra" / "config.yaml",
            run / ".hydra" / "overrides.yaml",
            run / "pipeline.log",
            run / ".lock",
            run / "run.json",
        ]
        before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched}
        second = Proc(
            [*LONG, f"paths.output_dir={out}", "trainer.log_every=100"], tmp_path / "cwd2"
        )
        assert second.wait() == 2
        assert "is in use by another process" in second.stderr and str(run) in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 or "Traceback" not in second.stderr
        after = {
            p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched if p.name != "pipeline.log"
        }
        assert after == {p: v for p, v in before.items() if p.name != "pipeline.log"}
        assert (
            before[run / "pipeline.log"][0] in (run / "pipeline.log").read_bytes()
        )  # only the owner appends
        assert b"in use" not in (run / "pipeline.log").read_bytes()
        assert first.p.poll() is None  # the first run carries on undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait() == 75


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,targets",
    [
        (
            (
                *KERNODECK,
                "trainer.max_steps=4000",
                "trainer.eval_every=500",
                "trainer.log_every=1",
                "checkpoint=every_n_steps",
                "checkpoint.every_steps=250",
            ),
            (600, 1700, 2900),
        ),
        (
            (
                *TINY,
                "trainer.max_steps=900",
                "trainer.eval_every=200",
                "checkpoint.every_steps=200",
            ),
            (150, 420, 700),
        ),
    ],
    ids=["kernodeck", "minigpt"],
)
def test_sigterm_at_three_steps_then_resume_is_bit_identical(tmp_path, args, targets):
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    ref = Proc([*args, f"paths.output_dir={ref_out}"], tmp_path / "cwd")
    assert ref.wait() == 0, ref.stderr
    stopped_at = []
    for target in targets:
        proc = Proc([*args, f"paths.output_dir={out}"], tmp_path / "cwd")
        wait_until(lambda target=target: steps_logged(out) >= target, f"step {target}", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait() == 75, proc.stderr
        status = RunDir(the_run(out)).read_status()
        assert status["status"] == "preempted"
        stopped_at.append(status["step"])
    assert len(set(stopped_at)) == 3 and stopped_at == sorted(stopped_at), stopped_at
    assert Proc([*args, f"paths.output_dir={out}"], tmp_path / "cwd").wait() == 0
    a, b = RunDir(the_run(out)), RunDir(the_run(ref_out))
    assert without_time(a.read_metrics()) == without_time(
        b.read_metrics()
    )  # every loss, lr and grad norm
    assert a.store.links() == b.store.links()
    for (sa, da), (sb, db) in zip(a.store.steps(), b.store.steps(), strict=True):
        assert sa == sb
        for name in ("weights.safetensors", "optim.safetensors", "extra.json"):
            assert (da / name).read_bytes() == (db / name).read_bytes(), (sa, name)


def test_a_damaged_newest_checkpoint_is_skipped_saying_why(tmp_path, cli, finished_job):
    out = tmp_path / "out"
    args = (
        *KERNODECK,
        "trainer.max_steps=40",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=10",
        "~stages.best_val",
    )
    ref = finished_job(*args)  # the uninterrupted run (in-process: the same bytes as the command's)
    killed = subprocess.run(
        [sys.executable, "-m", "pipeline", *args, f"paths.output_dir={out}"],
        env={**env_for_subprocess(), "PIPELINE_CHAOS": "train:70"},
        capture_output=True,
        text=True,
    )  # 2 kill points per step: killed inside step 35
    assert killed.returncode == -signal.SIGKILL
    store = RunDir(the_run(out)).store
    assert [s for s, _ in store.steps()] == [10, 20, 30]
    weights = store.root / "step-00000030" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # one flipped bit in tensor data: safetensors itself would load this silently
    weights.write_bytes(bytes(data))
    r = cli(*args, f"paths.output_dir={out}")
    assert r.returncode == 0, r.stderr
    log = r.stderr + r.stdout
    assert "step-00000030" in log and "sha256 differs" in log and "falling back" in log
    assert "resuming from step 20" in log
    a, b = RunDir(the_run(out)), RunDir(the_run(ref))
    assert without_time(a.read_metrics()) == without_time(b.read_metrics())
    assert [s for s, _ in a.store.steps()] == [s for s, _ in b.store.steps()]
    assert (a.store.link_dir("final") / "weights.safetensors").read_bytes() == (
        b.store.link_dir("final") / "weights.safetensors"
    ).read_bytes()


def test_json_written_by_a_run_is_standard(tmp_path, cli):
    out = tmp_path / "out"
    assert cli(*TINY, f"paths.output_dir={out}").returncode == 0
    for p in the_run(out).rglob("*"):
        if p.suffix in (".json", ".jsonl"):
            for text in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
                json.loads(text, parse_constant=lambda c, p=p: pytest.fail(f"{p}: bare {c}"))
    assert os.listdir(tmp_path / "cwd") == []


def test_a_signal_a_library_wrapped_while_importing_is_still_an_interruption(monkeypatch, capsys):
    """Seen once: the handler's Interrupted, raised while a dataclass was being created during an import,
    came out as `RuntimeError: Error calling __set_name__`; it is the interruption, exit 75, not a traceback."""
    from pipeline.run.signals import SIGNALS_STATE, Interrupted, run_command

    def importing():
        try:
            raise Interrupted(signal.SIGTERM)
        except Interrupted as e:
            raise RuntimeError("Error calling __set_name__ on '_FieldInfo' instance") from e

    monkeypatch.setattr(
        SIGNALS_STATE, "finish", lambda: None
    )  # this test process keeps its handlers
    monkeypatch.setattr(SIGNALS_STATE, "received", signal.SIGTERM)
    monkeypatch.setattr(SIGNALS_STATE, "held", False)
    with pytest.raises(SystemExit, match="75"):
        run_command("pipeline", importing)
    assert capsys.readouterr().err == "pipeline: interrupted by SIGTERM; nothing was written\n"
    monkeypatch.setattr(SIGNALS_STATE, "received", None)  # no signal: the error is the error
    with pytest.raises(RuntimeError, match="Error calling __set_name__"):
        run_command("pipeline", importing)


def test_a_tool_is_one_module_and_both_spellings_run_it(tmp_path):
    """`python -m pipeline show` and `python -m pipeline.show` run pipeline/cli/show.py, imported once."""
    import pipeline.cli.show
    import pipeline.show

    assert (
        pipeline.show is pipeline.cli.show
        and pipeline.cli.show.__spec__.name == "pipeline.cli.show"
    )
    for argv in (["pipeline", "show"], ["pipeline.show"]):
        p = subprocess.run(
            [sys.executable, "-m", *argv, str(tmp_path / "nowhere")],
            env=env_for_subprocess(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        said = f"pipeline.show: {tmp_path / 'nowhere'}: not a directory\n"
        assert (p.returncode, p.stdout, p.stderr) == (2, "", said)
