"""ARCHITECTURE.md's owners, checked: CheckpointDir alone writes inside a checkpoint directory, RunDir alone says
where a run's checkpoints/ lies."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from conftest import TINY, run_job, the_run

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
OWNER = "pipeline.checkpoint.directory"
# A path inside a checkpoint directory: a step directory (or its hidden temporary) is one of its parents.
INSIDE = re.compile(r"(^|/)(\.tmp-)?step-\d{8,}[^/]*/[^/]+$")
# What creates, changes or removes a file, as sys.audit names it (open: with a write flag).
WRITES = {
    "os.rename",
    "os.replace",
    "os.symlink",
    "os.link",
    "os.mkdir",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.utime",
    "os.chmod",
    "shutil.copyfile",
    "shutil.move",
    "shutil.rmtree",
}
WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND
_recording: list | None = None


def _module_of(frame) -> str | None:
    """The first pipeline module, outside pipeline/files/ (the tools every writer uses), on the call stack (None:
    the test's own write)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("pipeline.") and not name.startswith("pipeline.files."):
            return name
        frame = frame.f_back
    return None


def _hook(event: str, args: tuple) -> None:
    if _recording is None or not (event in WRITES or event == "open"):
        return
    if event == "open" and not (
        (args[2] is not None and args[2] & WRITE_FLAGS) or (args[1] and set(args[1]) & set("wax+"))
    ):
        return
    for path in (
        args[:2]
        if event
        in ("os.rename", "os.replace", "os.symlink", "os.link", "shutil.copyfile", "shutil.move")
        else args[:1]
    ):
        if (
            isinstance(path, (str, Path))
            and INSIDE.search(str(path))
            and (module := _module_of(sys._getframe(1)))
        ):
            _recording.append((module, event, str(path)))


sys.addaudithook(
    _hook
)  # audit hooks cannot be removed: this one records only while a test asks it to


@pytest.fixture
def writes():
    global _recording
    _recording = []
    try:
        yield _recording
    finally:
        _recording = None


@pytest.mark.slow
def test_only_checkpoint_dir_writes_inside_a_checkpoint(tmp_path, writes, monkeypatch):
    """A run saving and rotating its checkpoints, a resume setting a superseded history aside (also onto another
    filesystem, where it is copied), and the archive copying a run: every file created inside a checkpoint
    directory is created by CheckpointDir (or the tensor writer it calls, in its own thread)."""
    from conftest import cross_device

    from pipeline.checkpoint.directory import WEIGHTS
    from pipeline.cli import archive
    from pipeline.run.directory import RunDir

    out = tmp_path / "out"
    assert run_job(*TINY, f"paths.output_dir={out}")[0] == 0
    run = the_run(out)
    newest = RunDir(run).store.steps()[-1][1]
    (newest / WEIGHTS).write_bytes(b"damaged")
    assert (
        run_job(*TINY, f"paths.output_dir={out}")[0] == 0
    )  # the damaged one set aside, the run resumed
    assert (
        run_job(*TINY, f"paths.output_dir={out}", "resume=never")[0] == 0
    )  # the history superseded
    with monkeypatch.context() as m:  # superseded/ on another filesystem: what goes there is copied
        cross_device(m, run / "superseded")
        (RunDir(run).store.steps()[-1][1] / WEIGHTS).write_bytes(b"damaged")
        assert run_job(*TINY, f"paths.output_dir={out}")[0] == 0  # set aside, copied
        for _, step in RunDir(
            run
        ).store.steps():  # none usable: a fresh start moves the history, copied
            (step / "manifest.json").write_text("{}")
        assert run_job(*TINY, f"paths.output_dir={out}")[0] == 0
    assert any("/superseded/" in path for _, _, path in writes), writes  # the copies were seen
    archived = archive.main([str(run), str(tmp_path / "dest")])
    assert {event for _, event, _ in writes} >= {"open"}, writes  # the hook saw the saves
    assert any("/dest/" in path or "/.tmp-dest" in path for _, _, path in writes), (
        writes
    )  # and the archive's
    writers = {module for module, _, _ in writes}
    assert writers <= {OWNER, "pipeline.checkpoint.tensors"}, sorted(
        set(writes) - {w for w in writes if w[0] == OWNER}
    )
    assert archived == 0


def _modules() -> dict[str, ast.Module]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): ast.parse(p.read_text())
        for p in PACKAGE.rglob("*.py")
    }


def _imports_tensors(n: ast.AST) -> bool:
    """The tensors module imported in any form: from it, by its module name, or as a module of its package."""
    if isinstance(n, ast.ImportFrom) and n.module == "pipeline.checkpoint":
        return any(a.name == "tensors" for a in n.names)
    if isinstance(n, ast.Import):
        return any(a.name == "pipeline.checkpoint.tensors" for a in n.names)
    return isinstance(n, ast.ImportFrom) and n.module == "pipeline.checkpoint.tensors"


def test_only_checkpoint_dir_uses_the_tensor_writer():
    """The safetensors writer and reader serve CheckpointDir alone."""
    users = {
        name for name, tree in _modules().items() for n in ast.walk(tree) if _imports_tensors(n)
    }
    assert users == {OWNER}


def test_only_run_directory_says_where_checkpoints_lie():
    """ "checkpoints" as a path (a path component of a string, not prose) is spelled in run/directory.py, which puts
    the store in the run, and in checkpoint/directory.py, whose link rule must know the store when it sees it;
    the two agree."""
    from pipeline.checkpoint.directory import STORE
    from pipeline.run.directory import RunDir

    component = re.compile(r"^(?:[^ ]*/)?checkpoints(?:/[^ ]*)?$")
    spelled = set()
    for name, tree in _modules().items():
        # not a path: a docstring, a key of a dict (a report's "checkpoints") or of a subscript
        skip = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        skip |= {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys}
        skip |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
        spelled |= {
            name
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and id(n) not in skip
            and component.match(n.value)
        }
    assert spelled == {"pipeline.run.directory", OWNER}
    assert RunDir(Path("r")).store.root == Path("r") / STORE
