"""Exit codes (pipeline/config/errors.py): defined once, and every entry point names them, never a literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipeline
from pipeline.config import errors

PACKAGE = Path(pipeline.__file__).parent


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield (
            path.relative_to(PACKAGE.parent).as_posix(),
            ast.parse(path.read_text(encoding="utf-8")),
        )


def test_the_exit_codes_are_the_readmes():
    assert (errors.EXIT_OK, errors.EXIT_ERROR, errors.EXIT_BAD_INPUT, errors.EXIT_PREEMPTED) == (
        0,
        1,
        2,
        75,
    )


def test_exit_codes_are_defined_in_one_module():
    defined = [
        (name, node.lineno)
        for name, tree in modules()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in ast.walk(target)
        if isinstance(t, ast.Name) and t.id.startswith("EXIT_")
    ]
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
                    if (
                        isinstance(r, ast.Return)
                        and r.value is not None
                        and any(_literal_int(v) for v in ast.walk(r.value))
                    ):
                        found.append(f"{name}:{r.lineno}")
    assert not found, found


def test_a_commands_refusal_is_one_line_on_stderr_naming_it_and_its_code(capsys):
    from pipeline.run.signals import command

    @command("pipeline.show")
    def main(error):
        raise error

    assert main(errors.CommandError("x: not a directory")) == errors.EXIT_BAD_INPUT == 2
    assert capsys.readouterr() == ("", "pipeline.show: x: not a directory\n")
    assert main(errors.CommandError("a check failed", exit_code=errors.EXIT_ERROR)) == 1
    assert capsys.readouterr().err == "pipeline.show: a check failed\n"
    with pytest.raises(ZeroDivisionError, match="a bug"):  # a bug keeps its traceback
        main(ZeroDivisionError("a bug"))


def test_every_error_of_ours_carries_its_code_and_one_map_gives_a_librarys():
    import errno

    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    from pipeline.checkpoint.errors import CheckpointError
    from pipeline.files.atomic import UnsafePathError
    from pipeline.run.directory import RunBusyError
    from pipeline.run.loop import NonFiniteError
    from pipeline.run.plan import DriftError

    bad_input = [
        errors.ConfigError("k=v: out of range"),
        CheckpointError("/c", "manifest.json", "missing"),
        DriftError("drift"),
        RunBusyError("busy"),
        UnsafePathError(errno.EEXIST, "/x: a link"),
    ]
    assert [errors.exit_code(e)[0] for e in bad_input] == [errors.EXIT_BAD_INPUT] * 5
    assert errors.exit_code(NonFiniteError("loss is nan")) == (errors.EXIT_ERROR, "loss is nan")
    full = errors.exit_code(OSError(errno.ENOSPC, "No space left on device", "/out/x"))
    assert full[0] == errors.EXIT_ERROR and full[1].startswith(
        "cannot write /out/x: No space left on device"
    )
    assert errors.exit_code(ConfigCompositionException("no such group"))[0] == errors.EXIT_BAD_INPUT
    assert (
        errors.exit_code(ValidationError("not a float"))[1] == "bad config or override: not a float"
    )
    assert errors.exit_code(errors.Refusal(errors.CommandError("too many jobs"))) == (
        2,
        "too many jobs",
    )
    assert errors.exit_code(ZeroDivisionError("a bug")) is None
    assert errors.exit_code(OSError(errno.ENOENT, "No such file")) is None


@pytest.mark.parametrize(
    "override, said, fix, key, value",
    [
        # a value of the wrong type: the key is right, so no "did you mean" (it named the key typed)
        (
            "optimizer.lr=abc",
            "optimizer.lr=abc: Value 'abc' of type 'str' could not be converted to Float\n",
            None,
            "",
            0,
        ),
        (
            "optimizer.lrr=0.01",
            "; did you mean optimizer.lr?\n",
            "optimizer.lr=0.01",
            "optimizer.lr",
            0.01,
        ),
        # a stage that is off unless added: how to add it
        (
            "stages.early_stop.patience=3",
            "; stage early_stop is off unless added: add +stages/early_stop=default\n",
            "+stages/early_stop=default stages.early_stop.patience=3",
            "stages.early_stop.patience",
            3,
        ),
        # a pattern Hydra's grammar cannot read: once, with the override quoted as it would work
        (
            "stages.best_val.filename={step}-{val/loss:.3f}",
            "bad config or override: stages.best_val.filename={step}-"
            "{val/loss:.3f}: no viable alternative at input '{step}'; "
            "if the value is text, quote it for Hydra inside the "
            "shell's quotes: \"stages.best_val.filename='{step}-{val/loss:.3f}'\"\n",
            "\"stages.best_val.filename='{step}-{val/loss:.3f}'\"",
            "stages.best_val.filename",
            "{step}-{val/loss:.3f}",
        ),
    ],
    ids=["type", "typo", "stage-not-added", "unquoted"],
)
def test_a_refused_override_says_in_one_line_what_would_work(
    tmp_path, override, said, fix, key, value
):
    import functools
    import shlex

    from conftest import config_of, refused_in_one_line

    line = refused_in_one_line(
        ["experiment=kernodeck", override, f"paths.output_dir={tmp_path}"], tmp_path
    )
    assert line.endswith(said), line
    assert ("did you mean" in line) == ("did you mean" in said), line
    if (
        fix is not None
    ):  # what the line says to type, as the shell splits it, composes to the value meant
        config = config_of("experiment=kernodeck", *shlex.split(fix))
        assert functools.reduce(lambda node, k: node[k], key.split("."), config) == value
