"""Exit codes (pipeline/config/errors.py): defined once, and every entry point names them, never a literal."""
from __future__ import annotations

import ast
from pathlib import Path

import pipeline
from pipeline.config import errors

PACKAGE = Path(pipeline.__file__).parent


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def test_the_exit_codes_are_the_readmes():
    assert (errors.EXIT_OK, errors.EXIT_ERROR, errors.EXIT_BAD_INPUT, errors.EXIT_PREEMPTED) == (0, 1, 2, 75)


def test_exit_codes_are_defined_in_one_module():
    defined = [(name, node.lineno) for name, tree in modules() for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
               for t in ast.walk(target) if isinstance(t, ast.Name) and t.id.startswith("EXIT_")]
    assert {name for name, _ in defined} == {"pipeline/config/errors.py"}, defined


def _literal_int(node) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def test_no_entry_point_exits_with_a_literal():
    """sys.exit(2), SystemExit(75), os._exit(1), and `return 0` in a tool's main: each names errors.EXIT_*."""
    found = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _literal_int(node.args[0]):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in ("exit", "_exit", "SystemExit"):
                    found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and r.value is not None and any(
                            _literal_int(v) for v in ast.walk(r.value)):
                        found.append(f"{name}:{r.lineno}")
    assert not found, found


def test_refuse_is_one_line_on_stderr_naming_the_tool_and_exit_2(capsys):
    assert errors.refuse("pipeline.show", "x: not a directory") == errors.EXIT_BAD_INPUT == 2
    assert capsys.readouterr() == ("", "pipeline.show: x: not a directory\n")
