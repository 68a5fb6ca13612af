"""The suite's own machinery: a failing test shows the tail of its child processes' output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import CHILD_TAIL_LINES, PROJECT_ROOT, child_outputs

FAILING_CHILD = [
    sys.executable,
    "-c",
    "import sys\nfor i in range(100): print(f'line {i}', file=sys.stderr)\n"
    "print('the-real-reason', file=sys.stderr); sys.exit(3)",
]


def test_a_called_process_error_shows_the_tail_of_stderr():
    try:
        subprocess.run(FAILING_CHILD, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError:
        info = pytest.ExceptionInfo.from_current()
    ((title, tail),) = child_outputs(info)
    assert title.startswith("child stderr (exit 3): ") and sys.executable in title
    lines = tail.splitlines()
    assert (
        lines[0] == "..." and lines[-1] == "the-real-reason" and len(lines) == CHILD_TAIL_LINES + 1
    )
    assert lines[1] == f"line {100 - CHILD_TAIL_LINES + 1}"


def test_a_failed_assert_on_a_completed_process_shows_its_output():
    def check():
        proc = subprocess.run(FAILING_CHILD, capture_output=True, text=True)
        assert proc.returncode == 0

    try:
        check()
    except AssertionError:
        info = pytest.ExceptionInfo.from_current()
    ((title, tail),) = child_outputs(info)
    assert title.startswith("child stderr (proc, exit 3)") and tail.endswith("the-real-reason")


def test_the_hook_puts_it_in_the_failure_report(tmp_path):
    """The real hook in a real pytest run: the report of a test whose child fails shows the child's stderr."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_child.py").write_text(
        "import subprocess\n"
        f"def test_child():\n    subprocess.run({FAILING_CHILD!r}, check=True, capture_output=True, text=True)\n"
        f"def test_fine():\n    subprocess.run({FAILING_CHILD[:2]!r} + ['pass'], check=True)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT / "tests"), str(PROJECT_ROOT)]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "-c",
            str(tmp_path / "pytest.ini"),
            str(tmp_path / "test_child.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "child stderr (exit 3)" in proc.stdout and "the-real-reason" in proc.stdout, proc.stdout
    assert "line 50" not in proc.stdout.split("child stderr (exit 3)", 1)[1]  # only the tail
