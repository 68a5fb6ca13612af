"""Every failure path ends in one line and its exit code, with run.json truthful and nothing half-visible:
a full disk (tmpfs) during a save, while logging metrics, at the lock; a read-only medium; signals 50 ms
apart; a signal during set-up; interrupted tools; absurd sizes; refused runs that leave no trace."""

from __future__ import annotations

import glob
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    KERNODECK,
    Proc,
    env_for_subprocess,
    refused_in_one_line,
    run_pipeline,
    the_run,
    tree,
    wait_until,
)

from pipeline.run.directory import RunDir
from pipeline.verify.chaos import final_state, invalid_visible_checkpoints

PACED = ("trainer.max_steps=60", "checkpoint=every_n_steps", "checkpoint.every_steps=10")
# no checkpoint before step 30: metrics.jsonl (a line per step) outgrows its first page well before
LOGGING = (
    "trainer.max_steps=60",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=30",
    "trainer.eval_every=30",
)


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mounted at tmp_path/mnt (root only); remounted read-only by `read_only(path)`."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _remount(mnt: Path, mode: str) -> None:
    # the tracking agent a run started may still hold files open (busy): wait for it to go
    for _ in range(600):
        if (
            subprocess.run(
                ["mount", "-o", f"remount,{mode}", str(mnt)], capture_output=True
            ).returncode
            == 0
        ):
            return
        time.sleep(0.1)
    pytest.fail(f"could not remount {mnt} {mode}")


def _fill(directory: Path) -> Path:
    """A file taking every free byte of directory's filesystem."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        try:
            while True:
                os.write(fd, b"\0")
        except OSError:
            pass
    finally:
        os.close(fd)
    return filler


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr and "Logging error" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def reference(finished_job):
    """reference(args): the uninterrupted run's final state (weights, moments, every logged number), the job
    run to its end in-process once (the same bytes as the command: tests/run/test_budget.py)."""
    return lambda args: final_state(finished_job(*KERNODECK, *args))


def _same_as_reference(out: Path, args: tuple, reference) -> None:
    """The identical command, run again, ends where the uninterrupted run did, bit for bit."""
    proc = run_pipeline([*KERNODECK, *args, f"paths.output_dir={out}"], out.parent)
    assert proc.returncode == 0, proc.stderr
    got, want = final_state(out), reference(args)
    assert RunDir(the_run(out)).read_status()["status"] == "complete"
    for key in ("weights", "optim", "metrics", "step"):
        assert got[key] == want[key], key


@pytest.mark.slow
@pytest.mark.parametrize("when", ["save", "metrics"])
def test_a_full_disk_fails_in_one_line_says_so_in_run_json_and_the_same_command_finishes_bit_exact(
    tmpfs, tmp_path, reference, when
):
    out = tmpfs / "out"
    # "save": the disk fills once the first checkpoint exists; "metrics": once metrics.jsonl exists, and
    # every line is logged while no checkpoint comes before the run fails
    trigger, args = ("checkpoints/step-*", PACED) if when == "save" else ("metrics.jsonl", LOGGING)
    proc = Proc(
        [*KERNODECK, *args, f"paths.output_dir={out}"],
        tmp_path,
        env={"PIPELINE_CHAOS_PACE": "0.05"},
    )
    wait_until(lambda: glob.glob(str(out / "runs" / "*" / trigger)), trigger, proc)
    filler = _fill(tmpfs)
    assert proc.wait() == 1, proc.stderr
    line = _one_line(proc.stderr)
    assert (
        "No space left on device (ENOSPC)" in line and str(out) in line and "free space" in line
    ), line
    assert ("checkpoints" if when == "save" else "metrics.jsonl") in line, line
    status = the_run(out) / "run.json"
    import json

    record = json.loads(status.read_text())
    assert record["status"] == "failed" and "ENOSPC" in record["error"], record
    assert invalid_visible_checkpoints(out) == []
    filler.unlink()
    _same_as_reference(out, args, reference)


@pytest.mark.slow
def test_a_full_disk_at_the_lock_is_one_line_exit_1_and_no_run_directory(tmpfs, tmp_path):
    out = tmpfs / "out"
    (out / "runs").mkdir(parents=True)
    _fill(tmpfs)
    proc = run_pipeline([*KERNODECK, f"paths.output_dir={out}"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    line = _one_line(proc.stderr)
    assert "ENOSPC" in line and ".lock" in line, line
    assert os.listdir(out / "runs") == []


@pytest.mark.slow
def test_a_full_disk_while_the_corpus_is_made_is_one_line_exit_1_not_bad_input(tmpfs, tmp_path):
    out = tmpfs / "out"
    out.mkdir()
    _fill(tmpfs)
    proc = run_pipeline(
        [
            "data.n_sentences=2000",
            "trainer.max_steps=2",
            f"paths.output_dir={out}",
            "tracking=none",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, (
        proc.stderr
    )  # the machine's fault: the same command works once there is room
    line = _one_line(proc.stderr)
    assert "ENOSPC" in line, line
    assert list(out.glob("data/*/MANIFEST.json")) == []  # no corpus published half-made


@pytest.mark.slow
def test_a_read_only_medium_confirms_a_complete_run_and_writes_nothing(tmpfs, tmp_path):
    out = tmpfs / "out"
    args = [
        *KERNODECK[:1],
        "trainer.progress_bar=false",
        f"paths.output_dir={out}",
    ]  # tracking=mlflow: the default
    assert run_pipeline(args, tmp_path).returncode == 0
    preempted = [*KERNODECK, "trainer.max_steps=30", f"paths.output_dir={out}"]
    proc = Proc(
        [*preempted, "checkpoint=every_n_steps", "checkpoint.every_steps=2"],
        tmp_path,
        env={"PIPELINE_CHAOS_PACE": "0.05"},
    )
    wait_until(
        lambda: len(glob.glob(str(out / "runs" / "*" / "checkpoints" / "step-*"))) > 2,
        "a checkpoint",
        proc,
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    _remount(tmpfs, "ro")
    try:
        before = tree(tmpfs)
        done = run_pipeline(args, tmp_path)
        assert done.returncode == 0, done.stderr
        assert "is complete at step 10" in done.stdout
        not_done = run_pipeline(
            [*preempted, "checkpoint=every_n_steps", "checkpoint.every_steps=2"], tmp_path
        )
        assert not_done.returncode == 1, not_done.stderr
        assert "read-only" in _one_line(not_done.stderr)
        fresh = run_pipeline(
            [*KERNODECK, "trainer.max_steps=7", f"paths.output_dir={out}"], tmp_path
        )
        assert fresh.returncode == 1 and "Read-only file system (EROFS)" in _one_line(fresh.stderr)
        assert tree(tmpfs) == before
    finally:
        _remount(tmpfs, "rw")


def _send_signals(n: int, proc: Proc, gap: float = 0.05) -> None:
    for _ in range(n):
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("trial", range(3))
def test_more_sigterms_50ms_apart_change_nothing(tmp_path, reference, n, trial):
    out = tmp_path / "out"
    proc = Proc(
        [*KERNODECK, *PACED, f"paths.output_dir={out}"],
        tmp_path,
        env={"PIPELINE_CHAOS_PACE": "0.02"},
    )
    wait_until(lambda: glob.glob(str(out / "runs" / "*" / "metrics.jsonl")), "training", proc)
    time.sleep(0.3 * trial)  # a different moment of the run each time
    _send_signals(n, proc)
    assert proc.wait() == 75, proc.stderr
    assert "preempted at step" in _one_line(proc.stderr)
    import json

    assert json.loads((the_run(out) / "run.json").read_text())["status"] == "preempted"
    assert invalid_visible_checkpoints(out) == []
    _same_as_reference(out, PACED, reference)


@pytest.mark.slow
def test_a_sighup_preempts_a_run_like_sigterm(tmp_path):
    """A closed terminal (SIGHUP) checkpoints and exits 75, not -1 with the update lost."""
    import json

    out = tmp_path / "out"
    proc = Proc(
        [*KERNODECK, *PACED, f"paths.output_dir={out}"],
        tmp_path,
        env={"PIPELINE_CHAOS_PACE": "0.02"},
    )
    wait_until(lambda: glob.glob(str(out / "runs" / "*" / "metrics.jsonl")), "training", proc)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait() == 75, proc.stderr
    assert "preempted at step" in _one_line(proc.stderr)
    assert json.loads((the_run(out) / "run.json").read_text())["status"] == "preempted"
    assert invalid_visible_checkpoints(out) == []


@pytest.mark.slow
def test_a_signal_during_set_up_stops_at_once_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    args = [
        *KERNODECK,
        "trainer.max_steps=30",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=2",
        f"paths.output_dir={out}",
    ]
    proc = Proc(args, tmp_path, env={"PIPELINE_CHAOS_PACE": "0.05"})
    wait_until(
        lambda: len(glob.glob(str(out / "runs" / "*" / "checkpoints" / "step-*"))) > 1,
        "a checkpoint",
        proc,
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 75
    before = tree(out)
    trace = tmp_path / "trace"
    # the resume's set-up waits 600 s at its set-up point: only the signal can end it soon
    proc = Proc(
        args, tmp_path, env={"PIPELINE_CHAOS_PACE": "600", "PIPELINE_CHAOS_TRACE": str(trace)}
    )
    wait_until(lambda: trace.exists() and "setup" in trace.read_text(), "the set-up", proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    assert time.monotonic() - t0 < 300  # far below the 600 s it would otherwise wait
    assert "interrupted by SIGTERM while setting up the run; nothing was written" in _one_line(
        proc.stderr
    )
    assert tree(out) == before


def _handles_sigterm(pid: int) -> bool:
    """The process installed its own SIGTERM handler (SigCgt bit 15): signals are ours from now on."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_tool_says_so_in_one_line_and_exits_75(tmp_path, sig):
    """The one wrapper every tool's __main__ uses (signals.run_command), around a main() that waits."""
    code = (
        "import time; from pipeline.run.signals import run_command\n"
        "def main():\n    time.sleep(600)\n    return 0\n"
        "run_command('pipeline.sample', main)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env_for_subprocess(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: _handles_sigterm(p.pid), "the handlers")
        p.send_signal(sig)
        _out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 75, err
    assert _one_line(err) == f"pipeline.sample: interrupted by {sig.name}; nothing was written"


@pytest.mark.parametrize("entry", ["run_command", "module"])
def test_a_signal_while_the_handlers_are_installed_ends_in_one_line(entry):
    """The signal lands right after the first handler is in place, before install() returns (the race a
    poll of SigCgt then a kill hits): still one line and 75, from run_command and from a module's top level."""
    run = (
        "run_command('pipeline.sample', lambda: 0)"
        if entry == "run_command"
        else "SIGNALS_STATE.install()\nprint('installed')"
    )
    code = (
        "import os, signal\nreal = signal.signal\n"
        "def first_then_kill(s, h):\n    real(s, h)\n    os.kill(os.getpid(), signal.SIGTERM)\n"
        "signal.signal = first_then_kill\n"
        "from pipeline.run.signals import SIGNALS_STATE, run_command\n" + run + "\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env_for_subprocess(), capture_output=True, text=True
    )
    assert proc.returncode == 75, proc.stderr
    name = "pipeline.sample" if entry == "run_command" else "pipeline"
    assert _one_line(proc.stderr) == f"{name}: interrupted by SIGTERM; nothing was written"
    assert proc.stdout == ""


def test_every_tool_ends_through_run_command():
    root = Path(__file__).resolve().parents[2] / "pipeline"
    for name in (
        "cli/sample",
        "cli/evaluate",
        "cli/export_hf",
        "cli/show",
        "cli/reindex",
        "cli/register",
        "cli/roundtrip",
        "cli/archive",
        "verify/__main__",
        "__main__",
    ):
        text = (root / f"{name}.py").read_text()
        assert "run_command(" in text.split('if __name__ == "__main__":')[-1], name


def test_absurd_sizes_are_refused_up_front(tmp_path):
    line = refused_in_one_line(
        [str(tmp_path / "no-checkpoint"), "max_new_tokens=1000000000"],
        tmp_path,
        module="pipeline.sample",
    )
    assert "max_new_tokens=1000000000: at most 100,000" in line
    out = tmp_path / "out"
    line = refused_in_one_line(
        [
            "-m",
            *KERNODECK,
            "trainer.seed=range(0,1000)",
            "optimizer.lr=range(0,1000)",
            f"paths.output_dir={out}",
        ],
        tmp_path,
    )
    assert "1,000,000 jobs: at most 10,000" in line
    assert not out.exists()


def test_job_count_without_expanding():
    from pipeline.sweep.callback import job_count

    assert job_count(["a=1,2,3", "b=range(0,10,3)", "c=5"], {}) == 12
    assert job_count(["a=range(0,1000000)"], {"params": {"b": "1,2"}}) == 2_000_000
    assert job_count(["a=interval(0,1)"], {"n_trials": 20}) == 20


def _refused(args: list, cwd: Path) -> str:  # "run directory: ..." may be logged on stdout first
    proc = run_pipeline(args, cwd)
    assert proc.returncode == 2, proc.stderr
    return _one_line(proc.stderr)


@pytest.mark.slow
def test_a_refused_run_leaves_no_trace(tmp_path):
    fresh = tmp_path / "fresh" / "out"
    _refused(
        [*KERNODECK[1:], "model.n_head=3", "model.n_embd=16", f"paths.output_dir={fresh}"], tmp_path
    )
    _refused(
        [*KERNODECK, f"resume.source={tmp_path / 'nothing'}", f"paths.output_dir={fresh}"], tmp_path
    )
    assert not (tmp_path / "fresh").exists()
    used = tmp_path / "used"
    assert run_pipeline([*KERNODECK, f"paths.output_dir={used}"], tmp_path).returncode == 0
    final = the_run(used) / "checkpoints" / "final"
    before = tree(used)
    _refused(
        [*KERNODECK[1:], "model.n_head=3", "model.n_embd=16", f"paths.output_dir={used}"], tmp_path
    )
    _refused(
        [*KERNODECK, f"resume.source={tmp_path / 'nothing'}", f"paths.output_dir={used}"], tmp_path
    )
    line = _refused(
        [*KERNODECK, "optimizer.lr=0.05", f"resume.source={final}", f"paths.output_dir={used}"],
        tmp_path,
    )
    assert "refusing to resume" in line
    _refused(
        [*KERNODECK, "optimizer.lr=0.05", f"resume.source={final}", f"paths.output_dir={fresh}"],
        tmp_path,
    )
    assert tree(used) == before and not (tmp_path / "fresh").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parent", "absolute", "300 chars", "newline", "tab", "dot-dot"])
@pytest.mark.parametrize("mode", ["run", "multirun"])
def test_a_name_that_is_not_one_directory_name_is_refused_before_anything_is_made(
    tmp_path, kind, mode
):
    """`name` becomes <runs_dir>/<name>-<hash> (a sweep's <output_dir>/sweeps/<name>-<id>): a path in it, an
    absolute one, one too long for a file name or holding a control character is one line, exit 2, and nothing
    is created, neither the output directory nor anything beside it."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("precious\n")
    out = tmp_path / "a" / "b" / "out"
    name = {
        "parent": "../../escaped",
        "absolute": f"{sentinel}/x",
        "300 chars": "n" * 300,
        "newline": "'a\nb'",
        "tab": "a\tb",
        "dot-dot": "..",
    }[kind]  # the newline quoted: Hydra's lexer passes it on
    multirun = ["-m", "optimizer.lr=0.1,0.2"] if mode == "multirun" else []
    cwd = tmp_path / "cwd"
    before = tree(tmp_path)
    line = refused_in_one_line(
        [*multirun, *KERNODECK, f"name={name}", f"paths.output_dir={out}"], cwd
    )
    assert line.startswith("pipeline: name=") and repr(name.strip("'"))[:20] in line, line
    after = tree(tmp_path)
    assert stat.S_ISDIR(
        after.pop("cwd")[0]
    )  # the sentinel as it was, no output directory, no escape
    assert after == before
    assert not (tmp_path / "a").exists()


def test_the_one_name_check():
    from pipeline.files.names import NAME_MAX, SUFFIX_BYTES, BadName, checked, problem

    for bad in (
        "",
        ".",
        "..",
        "a/b",
        "/abs",
        "a\nb",
        "a\x00b",
        "a\x7fb",
        "a\u2028b",
        None,
        3,
        "é" * ((NAME_MAX - SUFFIX_BYTES) // 2 + 1),
    ):
        assert problem(bad) is not None, bad
    for good in (
        "default",
        "a.b",
        "...",
        "my run",
        "é" * ((NAME_MAX - SUFFIX_BYTES) // 2),
        "x" * NAME_MAX,
    ):
        assert problem(good, reserve=0) is None, good
    assert problem("x" * NAME_MAX) is not None  # a run's name leaves room for its suffixes
    with pytest.raises(BadName, match=r"^name='\.\./x': must not contain '/'"):
        checked("../x", "name")
    with pytest.raises(BadName) as e:
        checked("y" * 1000, "name")
    assert len(str(e.value)) < 200 and "\n" not in str(e.value)


def test_a_failing_log_stream_is_recorded_not_printed(capsys):
    import logging

    from pipeline.trainer.metrics_log import QuietFileHandler

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            raise OSError(28, "No space left on device")

    handler = QuietFileHandler(Full())
    logger = logging.getLogger("test-quiet")
    logger.addHandler(handler)
    try:
        logger.warning("one")
        logger.warning("two")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert isinstance(handler.error, OSError) and handler.error.errno == 28
    assert capsys.readouterr().err == ""


def test_run_json_in_place_when_the_disk_is_too_full_for_a_temporary(tmp_path, monkeypatch):
    import errno
    import json

    from pipeline.files import atomic
    from pipeline.run.directory import RunDir

    rundir = RunDir(tmp_path)
    rundir.write_status(status="running", step=3, metrics={"val/loss": 0.5}, note="x" * 300)
    size = rundir.status_path.stat().st_size

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "replace_file", full)
    with pytest.raises(OSError, match="No space"):  # not an ending: run.json stays as it was
        rundir.write_status(status="running", step=4)
    rundir.write_status(
        True,
        status="failed",
        step=4,
        metrics={"val/loss": 0.5},
        note="x" * 300,
        error="cannot write: ENOSPC " + "y" * 5000,
    )
    assert rundir.status_path.stat().st_size == size  # no new block needed
    record = json.loads(rundir.status_path.read_text())
    assert (
        record["status"] == "failed"
        and record["step"] == 4
        and record["error"].startswith("cannot write")
    )
    assert rundir.read_status() == record


@pytest.mark.slow
def test_sample_interrupted_by_ctrl_c_is_one_line_exit_75(tmp_path):
    from conftest import TINY

    out = tmp_path / "out"
    assert run_pipeline([*TINY, f"paths.output_dir={out}"], tmp_path).returncode == 0
    final = the_run(out) / "checkpoints" / "final"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.sample",
            str(final),
            "max_new_tokens=100000",
            f"paths.output_dir={out}",
        ],
        env=env_for_subprocess(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: _handles_sigterm(p.pid), "the handlers")
        time.sleep(1.0)  # into the checkpoint's load or the generation
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 75, err
    assert _one_line(err) == "pipeline.sample: interrupted by SIGINT; nothing was written"


@pytest.mark.parametrize(
    "module",
    [
        "pipeline.evaluate",
        "pipeline.sample",
        "pipeline.show",
        "pipeline.reindex",
        "pipeline.export_hf",
        "pipeline.roundtrip",
        "pipeline.verify",
        "pipeline.archive",
        "pipeline.register",
    ],
)
def test_a_signal_while_a_tool_is_still_imported_ends_in_one_line(module, tmp_path):
    """Every tool takes over the signals before its other imports, and a signal raised at module level (no
    try of run_command around it yet) still ends in one line and 75, not a traceback nor -15."""
    # the child runs the tool's module as __main__ (as `python -m` does) and is signalled at its first import
    # after the take-over
    code = (
        "import os, signal, sys, runpy, builtins\n"
        "real = builtins.__import__\n"
        "def slow(name, *a, **k):\n"
        "    m = sys.modules.get('pipeline.run.signals')\n"
        "    if getattr(getattr(m, 'SIGNALS_STATE', None), 'installed', False):"
        "  # the first import after the take-over\n"
        "        builtins.__import__ = real\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = slow\n"
        f"sys.argv = ['{module}', '--help']\n"
        f"runpy.run_module('{module}' + ('.__main__' if '{module}'.endswith('verify') else ''), "
        "run_name='__main__', alter_sys=True)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env_for_subprocess(),
    )
    assert p.returncode == 75, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.strip().splitlines() == [
        f"{module}: interrupted by SIGTERM; nothing was written"
    ], p.stderr


def test_metrics_are_read_line_by_line_each_bounded(tmp_path):
    """A torn last line is dropped, a damaged or oversized one named by its number (read in bounded pieces)."""
    from pipeline.checkpoint.errors import RunFileError
    from pipeline.run.directory import MAX_METRICS_LINE, RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert run.read_metrics() == []
    run.metrics_path.write_bytes(b'{"step": 1}\n{"step": 2, "loss": 0.5}\n{"step": 3')
    assert run.read_metrics() == [{"step": 1}, {"step": 2, "loss": 0.5}]
    run.metrics_path.write_bytes(b'{"step": 1}\n{"step": 2, "step": 3}\n')
    with pytest.raises(RunFileError, match="line 2: duplicate key 'step'"):
        run.read_metrics()
    run.metrics_path.write_bytes(
        b'{"step": 1}\n' + b" " * (MAX_METRICS_LINE + 5) + b'{"step": 2}\n'
    )
    with pytest.raises(RunFileError, match="line 2: over the 1048576-byte limit of a line"):
        run.read_metrics()


@pytest.mark.slow
def test_roundtrip_removes_a_planted_link_in_its_directory_never_what_it_points_at(tmp_path):
    out = tmp_path / "out"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "v.txt").write_text("precious\n")
    from pipeline.config.compose import compose, to_plain
    from pipeline.config.identity import run_name

    config = to_plain(compose([*KERNODECK, f"paths.output_dir={out}"]))
    home = out / "roundtrip" / run_name(config)
    home.mkdir(parents=True)
    os.symlink(victim, home / "checkpoint")
    p = run_pipeline([*KERNODECK, f"paths.output_dir={out}"], tmp_path, module="pipeline.roundtrip")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert (victim / "v.txt").read_text() == "precious\n"
