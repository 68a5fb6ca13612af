"""ARCHITECTURE.md: importing a module changes no process state, but for one thing it names. Importing `pipeline`
in a fresh interpreter appends its finder for the tools' older names to sys.meta_path, and changes nothing else a
process can observe: signal handlers, the hooks Python calls, threads, the working directory, the environment,
logging, the umask."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import PROJECT_ROOT, env_for_subprocess

SNAPSHOT = """
import atexit, faulthandler, json, logging, os, signal, sys, threading, warnings

def state():
    umask = os.umask(0o22)
    os.umask(umask)
    root = logging.getLogger()
    loggers = logging.root.manager.loggerDict.items()
    levels = {n: lg.level for n, lg in loggers if isinstance(lg, logging.Logger)}
    return {
        "meta_path": [f"{type(f).__module__}.{type(f).__qualname__}" for f in sys.meta_path],
        "path_hooks": [repr(h) for h in sys.path_hooks],
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        "hooks": [repr(h) for h in (sys.excepthook, sys.unraisablehook, sys.displayhook, sys.breakpointhook)],
        "trace": [repr(sys.gettrace()), repr(sys.getprofile()), faulthandler.is_enabled()],
        "threads": sorted(t.name for t in threading.enumerate()),
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "umask": umask,
        "atexit": atexit._ncallbacks(),
        "logging": [root.level, [repr(h) for h in root.handlers], logging.root.manager.disable, levels],
        "warnings": [repr(f) for f in warnings.filters],
        "std": [id(sys.stdin), id(sys.stdout), id(sys.stderr)],
        "recursion": sys.getrecursionlimit(),
        "path": list(sys.path),
    }

before = state()
import pipeline
after = state()
print(json.dumps({"before": before, "after": after}))
"""


def test_importing_pipeline_adds_its_tool_finder_to_sys_meta_path_and_changes_nothing_else():
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT],
        cwd=PROJECT_ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    before, after = got["before"], got["after"]
    assert after.pop("meta_path") == [*before.pop("meta_path"), "pipeline._ToolNames"]
    assert after == before


def test_the_tools_older_names_are_the_tools_themselves():
    """What the finder is for: `import pipeline.sample` is the module pipeline.cli.sample (one object)."""
    code = "import pipeline.sample, pipeline.cli.sample as c, sys; print(sys.modules['pipeline.sample'] is c)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env_for_subprocess(), capture_output=True, text=True
    )
    assert proc.stdout.strip() == "True", proc.stderr
