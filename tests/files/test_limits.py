"""Every read limit lives in pipeline/files/limits.py: no other module holds a MAX_* int of its own (each module
imported, in a fresh process), and no reader is handed a number written at its call."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from conftest import PROJECT_ROOT, env_for_subprocess

from pipeline.files import limits

PACKAGE = PROJECT_ROOT / "pipeline"
# Module-level MAX_* ints (by name, wherever imported) that bound no read: what a run writes, shows, keeps
# or accepts, each with its reason.
NOT_READS = {
    "MAX_PRECISION": "digits a checkpoint's filename pattern may format",
    "MAX_NEW_TOKENS": "tokens one sample generates",
    "MAX_HINTED": "changes a refusal's hint lists",
    "MAX_JOBS": "jobs one multirun may ask for",
    "MAX_ROWS": "rows of a sweep's end table",
    "MAX_CELL": "characters of one cell of it",
    "MAX_PARAM_VALUE": "mlflow's limit on a param value written",
    "MAX_TAG_VALUE": "mlflow's limit on a tag value written",
    "MAX_PENDING": "metric points batched into one log_batch",
    "MAX_METRICS_LINES": "metrics lines batched into one message",
    "MAX_HOSTS": "hosts a store's tag records",
    "MAX_VOCAB": "tokens a generated corpus may have",
    "MAX_TOKEN": "characters of one token of data.json (a value check)",
    "MAX_JOIN": "characters of data.json's decode_join (a value check)",
    "MAX_SPECIALS": "roles of data.json's specials (a value check)",
    "MAX_HOPS": "links followed to a checkpoint directory",
}
# generator_pyfunc_model is the code mlflow runs when it loads a model: importing it registers one
SCRIPT = """
import importlib, json, pkgutil, pipeline
out = {}
for m in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
    if m.name.endswith("generator_pyfunc_model"):
        continue
    module = importlib.import_module(m.name)
    for k, v in vars(module).items():
        if k.startswith("MAX_") and type(v) is int:
            out[f"{m.name}.{k}"] = v
print(json.dumps(out))
"""


def test_no_module_but_limits_holds_a_read_limit_of_its_own():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env_for_subprocess(),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    own = {k: v for k, v in vars(limits).items() if k.startswith("MAX_")}
    assert own and all(type(v) is int and v > 0 for v in own.values())
    assert {f"pipeline.files.limits.{k}" for k in own} <= set(found)
    strays = {
        k: v
        for k, v in found.items()
        if (name := k.rsplit(".", 1)[1]) not in NOT_READS and own.get(name) != v  # limits' own
    }
    assert not strays, f"read limits outside pipeline/files/limits.py: {strays}"
    assert set(NOT_READS) <= {k.rsplit(".", 1)[1] for k in found}, "a NOT_READS name gone"


READERS = {"read", "read_bytes", "open_file", "sha256", "copy_new", "read_line", "chunks"}


def _literal(node: ast.expr) -> bool:
    """A number written at the call (64, 1 << 20, 16 * 2**20), not a name."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def test_no_reader_is_handed_a_number_written_at_its_call():
    """jsonio.read, reading.read_bytes/open_file/sha256/copy_new/chunks and read_line take a limit: a name from
    limits (or a size a manifest lists), never a literal (which is a second home for a read limit)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in READERS:
                continue
            limit = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "limit")]
            if any(_literal(a) for a in limit):
                found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}")
    assert not found, f"a read limit written at its call: {found}"
