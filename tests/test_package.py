"""The package's shape: no import cycles, one module for the run directory's layout, no test doubles inside."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"


def modules() -> dict[str, ast.Module]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).replace(
            ".__init__", ""
        )
        out[name] = ast.parse(p.read_text())
    return out


def imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (none for any other node)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module] if isinstance(node, ast.ImportFrom) and node.module else []


def unit(module: str) -> str:
    """pipeline.checkpoint.store -> checkpoint; pipeline.run.loop -> run."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_cycle_between_subpackages_and_modules():
    """Regression: checkpoint -> model -> data -> checkpoint was a cycle at import time."""
    edges: dict[str, set[str]] = {}
    for name, tree in modules().items():
        # what importing the module imports (function-level imports are deferred)
        for node in tree.body:
            for target in imported(node):
                if target.startswith("pipeline.") and unit(target) != unit(name):
                    edges.setdefault(unit(name), set()).add(unit(target))
    state = {}

    def visit(n, path):
        state[n] = "open"
        for m in edges.get(n, ()):
            assert state.get(m) != "open", "import cycle: " + " -> ".join([*path, n, m])
            if m not in state:
                visit(m, [*path, n])
        state[n] = "done"

    for n in list(edges):
        if n not in state:
            visit(n, [])


def test_no_cycle_between_packages_function_level_imports_included():
    """Issue #31: serving imported generation from cli/sample.py while cli/register.py imported serving. A package
    (a first-level folder under pipeline/) reaches no package that reaches it back, through any import."""
    edges: dict[str, set[str]] = {}
    for name, tree in modules().items():
        for node in ast.walk(tree):
            edges.setdefault(unit(name), set()).update(
                unit(t)
                for t in imported(node)
                if t.startswith("pipeline.") and unit(t) != unit(name)
            )

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in edges.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in reach(a) if a < b and a in reach(b))
    assert cycles == []


def test_the_entry_the_run_and_tracking_share_no_state_through_globals():
    """The job, the sweep's parent and the tracker are passed as objects: no `global` statement in these layers,
    and the run layer imports nothing of tracking (the cycle test above checks the rest)."""
    shared = [
        (name, n.names)
        for name, tree in modules().items()
        if unit(name) in ("run", "tracking", "__main__")
        for n in ast.walk(tree)
        if isinstance(n, ast.Global)
    ]
    assert shared == []
    run_imports = [
        node.module
        for name, tree in modules().items()
        if unit(name) == "run"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("pipeline.tracking")
    ]
    assert run_imports == []


def test_one_module_knows_where_checkpoints_live():
    spelled = [
        name
        for name, tree in modules().items()  # path / "checkpoints"
        if any(
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Div)
            and isinstance(n.right, ast.Constant)
            and n.right.value == "checkpoints"
            for n in ast.walk(tree)
        )
    ]
    assert spelled == ["pipeline.run.directory"]


def test_no_test_doubles_in_the_package():
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith("unittest") for n in names), name


# The layers, lowest first: a module imports only from its own layer or lower ones (anywhere in the module: a
# function-level import is the same dependency, only later).
LAYERS = (
    ("files",),
    ("config",),
    ("stateful", "model", "data", "optimizer", "scheduler", "checkpoint", "stages", "trainer"),
    ("run",),
    ("sweep",),
    ("tracking",),
    ("verify",),
    ("cli", "serving", "__main__"),
)


def layer(module: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit(module) in units)


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for name, tree in modules().items():
        if name == "pipeline":
            continue
        for node in ast.walk(tree):
            found = imported(node)
            upward += [
                f"{name} -> {t}"
                for t in found
                if t.startswith("pipeline.") and layer(t) > layer(name)
            ]
    assert upward == []


def test_the_package_root_holds_a_handful_of_modules_none_named_like_the_standard_library():
    import sys

    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(root) <= 5, root
    clash = [name for name in modules() if name.split(".")[-1] in sys.stdlib_module_names]
    assert clash == []


CHECKPOINT_FILES = (
    "WEIGHTS",
    "OPTIM",
    "EXTRA",
    "MANIFEST",
    "DATA",
    "REQUIRED",
    "REQUIRED_BY",
)  # the store's names
# What must stay, each (module, what it names): roundtrip writes its own copy of the manifest under that name
# (a documented output, removed before the checkpoint exists); the served model's package imports nothing of
# the pipeline at import time, yet names the file its refusal is about.
NAMES_A_CHECKPOINT_FILE = {
    ("pipeline.cli.roundtrip", "manifest.json"),
    ("pipeline.serving", "data.json"),
}


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def test_only_the_checkpoint_store_names_a_checkpoints_files():
    """Issue #20: only pipeline/checkpoint/ reads or writes inside a checkpoint; everyone else asks the store
    (a path ending in one of its files, or one of its file-name constants, is a read or write of one)."""
    from pipeline.checkpoint import directory

    values = {
        getattr(directory, c) for c in CHECKPOINT_FILES if isinstance(getattr(directory, c), str)
    }
    assert values == {
        "weights.safetensors",
        "optim.safetensors",
        "extra.json",
        "manifest.json",
        "data.json",
    }
    named = set()
    for name, tree in modules().items():
        if unit(name) == "checkpoint":
            continue
        prose = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
                named |= {(name, v) for v in values if n.value == v or n.value.endswith("/" + v)}
            elif isinstance(n, ast.ImportFrom) and n.module == "pipeline.checkpoint.directory":
                named |= {(name, a.name) for a in n.names if a.name in CHECKPOINT_FILES}
            elif isinstance(n, ast.Attribute) and n.attr in CHECKPOINT_FILES:
                named.add((name, n.attr))
    assert named == NAMES_A_CHECKPOINT_FILE


def test_no_module_level_mutable_container_is_shared_with_another_unit():
    """A dict, list or set at a module's top level that another unit imports would be a process global
    between layers (the job, its sweep and its tracker are passed as objects instead)."""
    mutable = {}
    for name, tree in modules().items():
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if value is not None
                else []
            )
            if isinstance(
                value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
            ) or (
                isinstance(value, ast.Call)
                and getattr(value.func, "id", "") in ("dict", "list", "set", "defaultdict")
            ):
                mutable.update({(name, t.id): True for t in targets if isinstance(t, ast.Name)})
    shared = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and unit(node.module) != unit(name):
                shared += [
                    f"{name} imports {node.module}.{a.name}"
                    for a in node.names
                    if (node.module, a.name) in mutable
                ]
    assert shared == []


def test_tests_mirror_the_package():
    """A test file sits under the folder of the code it tests: tests/<unit>/ for pipeline/<unit>/."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    units = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    beyond = {"slurm": "the live cluster's tests", "examples": "the examples/ folder's tests"}
    assert folders - units - set(beyond) == set(), "a tests/ folder no pipeline/ unit is named by"


def test_no_module_imports_after_code():
    """No module runs code before its imports (`noqa: E402`), e.g. to take the signals over earlier than the entry
    wrapper does (tests/test_entry_signals.py states that promise by running every command)."""
    texts = {p.relative_to(PACKAGE.parent).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert [n for n, t in texts.items() if "noqa: E402" in t] == []
