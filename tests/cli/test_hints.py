"""What a new user is told: an unknown option names the group's options in one line, an install hint matches
how the pipeline was installed, a corpus being generated says so first, and --help neither imports mlflow nor
starts the tracking agent (nor rebuilds Hydra's config repository for every group it lists)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
from conftest import (
    KERNODECK,
    PROJECT_ROOT,
    TINY,
    env_for_subprocess,
    refused_in_one_line,
    run_pipeline,
    the_run,
)

from pipeline.config import compose
from pipeline.config.compose import install_hint

# -- an unknown option of a group ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, group, options, meant",
    [
        ("optimizer=adamm", "optimizer", "adam, adamw, sgd", "; did you mean optimizer=adam?"),
        ("model=minigtp", "model", "minigpt, mlp", "; did you mean model=minigpt?"),
        ("model=foo", "model", "minigpt, mlp", ""),  # nothing close: no guess
        (
            "+stages/early_stop=defualt",
            "stages/early_stop",
            "default",
            "; did you mean stages/early_stop=default?",
        ),
    ],
)
def test_an_unknown_option_is_one_line_listing_the_groups_options(
    tmp_path, override, group, options, meant
):
    err = refused_in_one_line([override, f"paths.output_dir={tmp_path / 'out'}"], tmp_path / "cwd")
    wrong = override.lstrip("+").replace("=", "/")
    assert err.strip() == (
        f"pipeline: bad config or override: In 'config': Could not find '{wrong}'; "
        f"available options in '{group}': {options}{meant}"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override, meant",
    [
        ("trainer.max_stpes=3", "trainer.max_steps"),
        ("optimzer.lr=0.1", "optimizer"),
        ("stages.best_val.moniter=val/ppl", "stages.best_val.monitor"),
    ],
)
def test_an_unknown_key_is_one_line_naming_the_closest_key(tmp_path, override, meant):
    err = refused_in_one_line([override, f"paths.output_dir={tmp_path / 'out'}"], tmp_path / "cwd")
    assert err.strip().startswith(
        f"pipeline: bad config or override: Could not override '{override.split('=')[0]}'"
    )
    assert err.strip().endswith(f"; did you mean {meant}?"), err
    assert not (tmp_path / "out").exists()


def test_a_key_nothing_is_close_to_gets_no_guess(tmp_path):
    err = refused_in_one_line(
        ["trainer.qqqqq=1", f"paths.output_dir={tmp_path / 'out'}"], tmp_path / "cwd"
    )
    assert err.strip().endswith("Key 'qqqqq' not in 'TrainerConf'"), err


def test_the_verifier_and_roundtrip_say_it_the_same_way(tmp_path):
    for module in ("pipeline.verify", "pipeline.roundtrip"):
        proc = run_pipeline(
            ["optimizer=adamm", f"paths.output_dir={tmp_path / 'out'}"], tmp_path / "cwd", module
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.strip().endswith(
            "available options in 'optimizer': adam, adamw, sgd; did you mean optimizer=adam?"
        ), proc.stderr


def test_error_line_keeps_one_line_whatever_hydra_gives():
    from hydra.errors import MissingConfigException

    from pipeline.config.errors import error_line

    e = MissingConfigException(
        "Cannot find primary config 'nope'.\n\nSearch path:\n\tprovider=main",
        missing_cfg_file="nope",
        options=["config"],
    )
    assert error_line(e) == "Cannot find primary config 'nope'; available options: config"
    assert (
        error_line(
            MissingConfigException(
                "In 'config': Could not load 'model/b'.\n\nSearch path:", missing_cfg_file="model/b"
            )
        )
        == "In 'config': Could not load 'model/b'"
    )


def test_evaluate_says_it_the_same_way(tmp_path, finished_job):
    best = the_run(finished_job(*KERNODECK)) / "checkpoints" / "best"
    err = refused_in_one_line([str(best), "data=foo"], tmp_path / "cwd", module="pipeline.evaluate")
    assert err.strip() == (
        "pipeline.evaluate: bad override: In 'config': Could not find 'data/foo'; "
        "available options in 'data': grammar, grammar_tiny, regression, text"
    )


# -- the install hint ---------------------------------------------------------------------------------


class FakeDistribution:
    def __init__(self, direct_url: dict | None):
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def installed_as(
    monkeypatch, direct_url: dict | None, *, found: bool = True, checkout: bool = False
) -> None:
    def distribution(name):
        assert name == "pipeline"
        if not found:
            raise importlib.metadata.PackageNotFoundError(name)
        return FakeDistribution(direct_url)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(compose, "in_checkout", lambda: checkout)


def test_an_editable_install_is_told_to_install_the_extra_editable_in_its_checkout(monkeypatch):
    installed_as(
        monkeypatch, {"url": "file:///home/me/my%20pipeline", "dir_info": {"editable": True}}
    )
    assert install_hint("hf") == 'pip install -e ".[hf]" in /home/me/my pipeline'


@pytest.mark.parametrize(
    "direct_url",
    [
        {
            "url": "file:///tmp/dist/pipeline-0.1.0-py3-none-any.whl",
            "archive_info": {},
        },  # docs/install.md's wheel
        {"url": "file:///home/me/pipeline", "dir_info": {}},  # pip install . (not editable)
        None,  # from an index: PEP 610 records nothing
    ],
)
def test_a_wheel_or_site_install_is_told_pip_install_pipeline_extra(monkeypatch, direct_url):
    installed_as(monkeypatch, direct_url)
    assert install_hint("hf") == "pip install 'pipeline[hf]'"


def test_a_checkout_that_was_never_installed_is_told_the_editable_install(monkeypatch):
    installed_as(monkeypatch, None, found=False, checkout=True)
    assert install_hint("hf") == f'pip install -e ".[hf]" in {PROJECT_ROOT}'


def test_export_hf_without_tokenizers_gives_the_hint(monkeypatch):
    from pipeline.cli.export_hf import tokenizer_files

    installed_as(
        monkeypatch, {"url": "file:///tmp/dist/pipeline-0.1.0-py3-none-any.whl", "archive_info": {}}
    )
    monkeypatch.setitem(
        sys.modules, "tokenizers", None
    )  # `import tokenizers` fails as if not installed
    with pytest.raises(ValueError, match="needs the `tokenizers` package") as e:
        tokenizer_files(["a", "b"], " ", 8)
    assert (
        str(e.value)
        == "writing the tokenizer needs the `tokenizers` package: pip install 'pipeline[hf]'"
    )


# -- a corpus being generated says so first -----------------------------------------------------------

FRESH_PROCESS = """
import sys, tempfile
from pipeline.data import grammar
real = grammar.build_grammar_corpus
def build(*a):
    print("BUILDING", file=sys.stderr, flush=True)
    return real(*a)
grammar.build_grammar_corpus = build
grammar.GrammarCorpus(tempfile.mkdtemp(), seed=3, n_sentences=200, val_fraction=0.1, block_size=16, ngram_order=4,
                      val_batch_size=32)
grammar.GrammarCorpus(tempfile.mkdtemp(), seed=3, n_sentences=200, val_fraction=0.1, block_size=16, ngram_order=4,
                      val_batch_size=32)
"""


def on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run args with stderr on a pseudo-terminal, as at a shell: (exit code, stdout, stderr)."""
    import os
    import pty
    import subprocess

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env_for_subprocess(),
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = proc.stdout.read()
    return proc.wait(), out, err.decode().replace("\r\n", "\n")


def test_a_tool_without_logging_prints_the_corpus_line_before_generating(tmp_path):
    """evaluate, sample and export configure no logging, where an INFO record would be dropped: on a terminal
    the line goes to stderr, once per generation, before it."""
    code, _, err = on_a_terminal([sys.executable, "-c", FRESH_PROCESS], tmp_path)
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 4 and lines[1::2] == ["BUILDING", "BUILDING"], lines
    for line in lines[0::2]:
        assert line.startswith(
            "generating the grammar corpus (seed=3, n_sentences=200, val_fraction=0.1, "
            "block_size=16, ngram_order=4) into "
        )
        assert line.endswith("; this takes a while once, then it is cached")


def test_on_a_pipe_stderr_stays_for_a_refusals_one_line(tmp_path):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stderr.splitlines() == ["BUILDING", "BUILDING"], (
        proc.stderr
    )


def test_a_run_logs_the_corpus_line_once_and_evaluate_on_other_data_prints_it(tmp_path):
    out = tmp_path / "out"
    run = run_pipeline([*TINY, f"paths.output_dir={out}"], tmp_path / "cwd")
    assert run.returncode == 0, run.stderr
    said = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "generating the grammar corpus" in line
    ]
    assert len(said) == 1 and said[0].endswith("then it is cached"), said
    best = the_run(out) / "checkpoints" / "best"
    again = run_pipeline(
        [*TINY, f"paths.output_dir={out}", "trainer.max_steps=13"], tmp_path / "cwd"
    )  # a new run
    assert again.returncode == 0 and "generating the" not in again.stdout + again.stderr  # cached

    code, stdout, err = on_a_terminal(
        [sys.executable, "-m", "pipeline.evaluate", str(best), "data.seed=7"], tmp_path
    )
    assert code == 0, err
    (line,) = err.splitlines()
    assert line.startswith("generating the grammar corpus (seed=7, ") and str(out / "data") in line
    assert stdout.startswith("step=")


# -- --help -------------------------------------------------------------------------------------------

PROBE = """
import atexit, json, runpy, sys
import hydra._internal.config_repository as repository
built = []
real = repository.CachingConfigRepository.__init__
def init(self, *a, **k):
    built.append(1)
    real(self, *a, **k)
repository.CachingConfigRepository.__init__ = init
def report():
    print(json.dumps({"repositories": len(built), "modules": sorted(sys.modules)}), file=sys.stderr)
atexit.register(report)
sys.argv = ["pipeline", *sys.argv[1:]]
runpy.run_module("pipeline", run_name="__main__")
"""


def probe(tmp_path, *args: str) -> tuple[str, dict]:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(proc.stderr.strip().splitlines()[-1])


def test_help_imports_no_mlflow_starts_no_agent_and_builds_one_repository(tmp_path):
    stdout, seen = probe(tmp_path, "--help", f"paths.output_dir={tmp_path / 'out'}")
    assert "optimizer: adam, adamw, sgd" in stdout and "== Config ==" in stdout
    modules = set(seen["modules"])
    assert not {m for m in modules if m.split(".")[0] == "mlflow"}
    assert "pipeline.tracking.agent" not in modules and "pipeline.run.job" not in modules
    # Hydra's own --help builds one per group it looks up (~150, 4-5x the time of --cfg job); here: one for
    # composing the config, one for every listing
    assert seen["repositories"] <= 2, seen["repositories"]
    _, cfg = probe(tmp_path, "--cfg", "job")
    assert seen["repositories"] <= cfg["repositories"] + 1
    assert not (tmp_path / "out").exists()


def test_help_lists_what_hydras_own_help_lists(tmp_path):
    """The one repository changes nothing in the text: the groups and options are Hydra's own listing's."""
    import subprocess

    ours = run_pipeline(["--help"], tmp_path)
    env = env_for_subprocess()
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, runpy; from pipeline import __main__ as m; "
            "m._one_repository_for_help = lambda stack: None; "
            "sys.argv = ['pipeline', '--help']; m.main()",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ours.returncode == 0 and plain.returncode == 0, ours.stderr + plain.stderr
    assert ours.stdout == plain.stdout
