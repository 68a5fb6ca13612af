"""The README and the pages under docs/ against what the commands do: every command they show names a module
that exists, composes and validates as written, and names the runs it makes; the tree of docs/outputs.md is the
tree a job, a sweep, a roundtrip and a verification write; .gitignore covers what the commands create; .ci/run
runs the README's test command, as written, in a fresh virtualenv."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import KERNODECK, PROJECT_ROOT, run_pipeline

README = (PROJECT_ROOT / "README.md").read_text()
PAGES = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
NAME_COLUMN = 34  # in the tree, the descriptions start at this column
FILE_TOKEN = re.compile(
    r"(?<![\w<>./-])([\w.<>-]+(?:/[\w.<>-]+)*(?:\.(?:jsonl?|tokens|safetensors|yaml|log|db)\b|/))"
)
# In the tree, but not written by the commands this test runs: why each is absent here.
CONDITIONAL = {
    "runs/<name>-<hash>/superseded/<when>/": "only after a resume that changes the config, falls back or starts anew",
    "sweeps/<name>-<sweep-id>/.submitit/<job-id>/": "only on SLURM",
}


def readme_block(heading: str, text: str = README) -> str:
    """The first code block under a `## heading` of a page (the README's by default), without its fence."""
    section = text.split(f"\n## {heading}\n", 1)[1]
    return section.split("```", 1)[1].split("\n", 1)[1].split("```", 1)[0]


def documented_tree(block: str) -> set[str]:
    """Every path the tree names (relative to its root, directories ending in /): the names in the name
    column, indented two spaces a level, and the files and directories a directory's description lists."""
    lines = block.splitlines()
    assert lines[0] == "outputs/"
    paths: set[str] = set()
    parents: list[str] = [""]
    last = ""
    for line in lines[1:]:
        level = (len(line) - len(line.lstrip(" "))) // 2
        names = line[:NAME_COLUMN].strip()
        if names:
            assert len(line) <= NAME_COLUMN or line[NAME_COLUMN - 1] == " ", f"misaligned: {line!r}"
            parents = parents[:level]
            for name in re.split(r" {2,}", names):
                name = name.split(" -> ")[0]  # a symlink: its name
                last = parents[-1] + name
                paths.add(last)
            if last.endswith("/"):
                parents.append(last)
        if last.endswith(
            "/"
        ):  # a directory's description (or its continuation line) may list its content
            paths.update(last + token for token in FILE_TOKEN.findall(line[NAME_COLUMN:]))
    # the directories a path passes through are in the tree too
    return paths | {p[: i + 1] for p in paths for i, c in enumerate(p[:-1]) if c == "/"}


def pattern(path: str) -> re.Pattern:
    """A documented name as a regex: <placeholder> stands for any name, ... for any rest, a digit for any."""
    parts = re.split(r"(<[^>]+>|\.\.\.|\d)", path.rstrip("/"))
    regex = "".join(
        {"...": ".+"}.get(
            p, "[^/]+" if p.startswith("<") else r"\d" if p.isdigit() else re.escape(p)
        )
        for p in parts
        if p
    )
    return re.compile(regex + "/?")


def real_tree(root: Path, documented: set[str]) -> set[str]:
    """Every path under root, down to where the documentation stops listing (a documented directory none of
    whose content is listed, like mlartifacts/, is one entry); symlinks are leaves."""
    listed = {
        d
        for d in documented
        if d.endswith("/") and any(p != d and p.startswith(d) for p in documented)
    }
    listed_dirs = [pattern(d) for d in listed]
    open_dirs = [pattern(d) for d in documented if d.endswith("/") and d not in listed]
    found = set()

    def walk(d: Path, rel: str) -> None:
        for p in sorted(d.iterdir()):
            name = rel + p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
            found.add(name)
            if name.endswith("/") and (
                any(d.fullmatch(name) for d in listed_dirs)
                or not any(o.fullmatch(name) for o in open_dirs)
            ):
                walk(p, name)

    walk(root, "")
    return found


def test_the_tree_parser_reads_names_placeholders_and_listed_files():
    block = (
        "outputs/\n  runs/<name>-<hash>/             one run\n    .hydra/  pipeline.log         logs\n"
        "    checkpoints/\n      step-00000768/              weights.safetensors, extra.json\n"
        "      best -> step-...            symlink\n  a.db  b/                        an index\n"
    )
    assert documented_tree(block) == {
        "runs/",
        "runs/<name>-<hash>/",
        "runs/<name>-<hash>/.hydra/",
        "runs/<name>-<hash>/pipeline.log",
        "runs/<name>-<hash>/checkpoints/",
        "runs/<name>-<hash>/checkpoints/step-00000768/",
        "runs/<name>-<hash>/checkpoints/step-00000768/weights.safetensors",
        "runs/<name>-<hash>/checkpoints/step-00000768/extra.json",
        "runs/<name>-<hash>/checkpoints/best",
        "a.db",
        "b/",
    }
    assert pattern("runs/<name>-<hash>/checkpoints/step-00000768/").fullmatch(
        "runs/k-0a1b/checkpoints/step-00000003/"
    )
    assert not pattern("runs/<name>-<hash>/").fullmatch("runs/k/x/")


@pytest.mark.slow
def test_where_outputs_go_is_the_tree_the_commands_write(tmp_path):
    out = tmp_path / "outputs"
    tiny = [
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "data.n_sentences=400",
        "data.block_size=16",
        "data.val_batch_size=16",
        "trainer.batch_size=8",
        "trainer.max_steps=6",
        "trainer.eval_every=3",
        "checkpoint=every_n_steps",
        "checkpoint.every_steps=3",
        "trainer.progress_bar=false",
        f"paths.output_dir={out}",
    ]  # tracking=mlflow, the default: the index is in the tree
    for args, module in [
        (tiny, "pipeline"),
        (["-m", *tiny, "optimizer.lr=0.002,0.003"], "pipeline"),
        ([*KERNODECK, f"paths.output_dir={out}"], "pipeline.roundtrip"),
        ([*KERNODECK, f"paths.output_dir={out}"], "pipeline.verify"),
    ]:
        proc = run_pipeline(args, tmp_path / "cwd", module=module)
        assert proc.returncode == 0, (module, proc.stderr)

    documented = documented_tree(
        readme_block("The tree", (PROJECT_ROOT / "docs" / "outputs.md").read_text())
    )
    real = real_tree(out, documented)
    patterns = {d: pattern(d) for d in documented}
    undocumented = sorted(p for p in real if not any(r.fullmatch(p) for r in patterns.values()))
    assert not undocumented, f"written but not in docs/outputs.md's tree: {undocumented}"
    conditional = {
        d
        for d in documented  # a conditional path, or a directory holding nothing else
        if all(any(c.startswith(p) for c in CONDITIONAL) for p in documented if p.startswith(d))
    }
    missing = sorted(
        d
        for d, r in patterns.items()
        if d not in conditional and not any(r.fullmatch(p) for p in real)
    )
    assert not missing, f"in docs/outputs.md's tree but not written: {missing}"
    assert set(CONDITIONAL) <= documented  # what is left out above is in the page


# -- the commands of every page -------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# A word the reader replaces (CHECKPOINT, DEST, <run>, $HOME, ~/myconf, your own package): not run as written.
PLACEHOLDER = re.compile(r"<|\$|~|\b[A-Z][A-Z_]+\b|\bmy(?:pkg|conf)\b")
MOONS_SEARCHPATH = "hydra.searchpath=[pkg://moons.conf]"


def commands(page: Path) -> list[str]:
    """Every command in the page's bash blocks: continuation lines joined, comments and `cd ... &&` left out."""
    found = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*", "", line).strip()
            for part in line.split(" && "):
                if part and not part.startswith(("#", "cd ")):
                    found.append(part)
    return found


def has_placeholder(command: str) -> bool:
    """A word the reader replaces, in the command (an environment prefix such as PYTHONPATH=... aside)."""
    return bool(PLACEHOLDER.search(re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", command)))


def pipeline_command(command: str) -> tuple[str, list[str]] | None:
    """(module, arguments) of a `python -m pipeline...` command (an environment prefix left out), else None."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
        return (words[2], words[3:]) if words[2].split(".")[0] == "pipeline" else None
    return None


def compositions(args: list[str]) -> list[list[str]]:
    """The override lists a job command composes: a sweep's choices expanded (each value once) through Hydra's own
    parser, a search sweep's ranges left to the sweeper, flags that only print (--cfg job, --help) left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides, skip = [], False
    for a in args:
        if skip or a in ("-m", "--multirun", "--help"):
            skip = False
            continue
        if a == "--cfg":
            skip = True
            continue
        overrides.append(a)
    runs: list[list[str]] = [[]]
    for parsed, text in zip(OverridesParser.create().parse_overrides(overrides), overrides):
        if parsed.is_sweep_override():
            if parsed.is_choice_sweep():
                values = [f"{parsed.get_key_element()}={v}" for v in parsed.sweep_string_iterator()]
                runs = [[*r, v] for r in runs for v in values]
            continue  # an interval or a tagged range: the sweeper samples it
        runs = [[*r, text] for r in runs]
    return runs


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, arguments) of every pipeline command on every page, as written."""
    return [
        (page.name, *parsed)
        for page in PAGES
        for c in commands(page)
        if (parsed := pipeline_command(c))
    ]


def test_the_pages_show_commands():
    """The parser finds what the pages show: a change to their format cannot make the checks below vacuous."""
    found = documented_commands()
    assert len(found) > 60 and {page for page, _, _ in found} >= {p.name for p in PAGES} - {
        "index.md"
    }
    assert (
        "README.md",
        "pipeline",
        ["-m", "experiment=kernodeck", "optimizer.lr=0.01,0.03,0.1"],
    ) in found
    assert compositions(
        ["-m", "hydra/sweeper=optuna", "optimizer.lr=tag(log,interval(1e-4,1e-2))", "a=1,2"]
    ) == [["hydra/sweeper=optuna", "a=1"], ["hydra/sweeper=optuna", "a=2"]]


def test_every_page_starts_with_a_runnable_example():
    for page in PAGES[1:]:
        text = page.read_text()
        first = FENCE.search(text)
        assert first and first.group(1) == "bash", (
            f"{page.name}: its first code block is not a bash example"
        )
        assert text[: first.start()].count("\n") <= 2, f"{page.name}: the example is not at the top"
        example = [c for c in commands(page) if c in first.group(2)]
        assert example and not any(map(has_placeholder, example)), (
            f"{page.name}: its example has a placeholder"
        )


def test_every_documented_command_names_a_module_that_runs():
    import importlib.util

    for page, module, _ in documented_commands():
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{page}: python -m {module}: no such module"
        if spec.submodule_search_locations is not None:  # a package runs through its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, (
                f"{page}: {module} has no __main__"
            )


def test_every_documented_job_composes_and_validates_as_written(monkeypatch):
    """Each `python -m pipeline ...`, `pipeline.verify` and `pipeline.roundtrip` command without a placeholder
    composes with the real configs (Hydra's own groups for launchers and sweepers included) and passes the checks
    a job makes before it starts; each run a page names by its directory (`runs/<name>-<hash>`) is a run one of
    the page's commands makes."""
    from conftest import compose
    from omegaconf import open_dict

    from pipeline.config.compose import to_plain
    from pipeline.config.identity import run_name
    from pipeline.config.schemas import validate

    monkeypatch.syspath_prepend(
        str(PROJECT_ROOT / "examples" / "moons")
    )  # PYTHONPATH=examples/moons
    checked: set[tuple[str, ...]] = (
        set()
    )  # each distinct override list once (a composition takes a second)
    names: set[str] = set()
    named: dict[str, set[str]] = {}
    for page in PAGES:
        for command in commands(page):
            parsed = pipeline_command(command)
            if (
                parsed is None
                or parsed[0] not in ("pipeline", "pipeline.verify", "pipeline.roundtrip")
                or has_placeholder(command)
                or "--config-dir" in parsed[1]
            ):
                continue
            for overrides in compositions(parsed[1]):
                if tuple(overrides) in checked:
                    continue
                cfg = compose(
                    *overrides, return_hydra_config=True
                )  # the hydra/ groups it names exist
                with open_dict(cfg):
                    del cfg["hydra"]  # resolved only inside a launched job (hydra.job.num)
                config = to_plain(cfg)
                validate(config)
                names.add(run_name(config))
                checked.add(tuple(overrides))
        named[page.name] = {
            m
            for _, body in FENCE.findall(page.read_text())
            for m in re.findall(r"runs/(\w+-[0-9a-f]{12})\b", body)
        }
    assert len(checked) > 25
    for page, runs in named.items():
        assert runs <= names, (
            f"{page}: names runs no documented command makes: {sorted(runs - names)}"
        )


# -- .gitignore ---------------------------------------------------------------------------------------

# What the commands of the README and docs/ create in a checkout, each with the command that does.
CREATED = {
    ".venv/bin/python": "a virtualenv in the checkout (python3 -m venv .venv)",
    "venv/bin/python": "the same, another usual name",
    "dist/pipeline-0.1.0-py3-none-any.whl": "python -m pip wheel --no-deps -w dist .",
    "build/lib/pipeline/__init__.py": "building the wheel",
    "pipeline.egg-info/PKG-INFO": "pip install -e .",
    "outputs/runs/default-0123456789ab/run.json": "python -m pipeline (from a checkout: the checkout's outputs/)",
    "multirun/2026-01-01/00-00-00/multirun.yaml": "Hydra's own multirun directory (hydra.sweep.dir unset)",
    "hf/config.json": "python -m pipeline.export_hf outputs/runs/<run>/checkpoints/final hf/",
    "mlruns/0/meta.yaml": "mlflow ui in the checkout",
    "mlflow.db": "an mlflow store in the checkout",
    "site/index.html": "python -m mkdocs build (the docs site)",
    ".pytest_cache/README.md": "python3 -m pytest -q",
    "tests/__pycache__/conftest.cpython-311.pyc": "python3 -m pytest -q",
}


def test_gitignore_covers_what_the_documented_commands_create(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    scratch = tmp_path / "checkout"
    scratch.mkdir()
    shutil.copy2(PROJECT_ROOT / ".gitignore", scratch / ".gitignore")
    subprocess.run(["git", "init", "-q", str(scratch)], check=True, capture_output=True, text=True)
    for path in CREATED:
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        (scratch / path).write_text("")
    proc = subprocess.run(
        ["git", "-C", str(scratch), "check-ignore", "--no-index", *CREATED],
        capture_output=True,
        text=True,
    )
    ignored = set(proc.stdout.split())
    assert not set(CREATED) - ignored, {p: CREATED[p] for p in set(CREATED) - ignored}
    # and nothing of the project's own: its sources stay visible
    kept = subprocess.run(
        [
            "git",
            "-C",
            str(scratch),
            "check-ignore",
            "--no-index",
            "pipeline/__init__.py",
            "conf/config.yaml",
            "tests/test_readme.py",
            ".ci/run",
            "README.md",
        ],
        capture_output=True,
        text=True,
    )
    assert kept.returncode == 1 and kept.stdout == "", kept.stdout


# -- .ci/run ------------------------------------------------------------------------------------------


def test_ci_runs_the_readmes_test_command_as_written_in_a_fresh_virtualenv():
    two = readme_block("Two commands").splitlines()
    command = two[two.index("# 2. install, then run the tests") + 1]
    assert command == 'python3 -m pip install -e ".[test]" && python3 -m pytest -q'
    script = (PROJECT_ROOT / ".ci" / "run").read_text().splitlines()
    lines = [line for line in script if line and not line.startswith("#")]
    assert lines[-1] == command  # the last command: its exit code is the script's
    venv = next(
        i
        for i, line in enumerate(lines)
        if re.fullmatch(r'"\$system_python" -m venv "\$venv_dir"', line)
    )
    activate = lines.index('source "$venv_dir/bin/activate"')
    assert venv < activate < len(lines) - 1
    assert "venv_dir=$(mktemp -d /tmp/pipeline-ci-venv.XXXXXX)" in lines
    # the cluster's tooling keeps the system interpreter, before and after the virtualenv
    assert not [line for line in lines if "cluster.py" in line and "$system_python" not in line]


def test_ci_is_a_valid_bash_script():
    """`bash -n` parses the whole script without running it: a merge's leftover marker fails here, not in CI."""
    proc = subprocess.run(
        ["bash", "-n", str(PROJECT_ROOT / ".ci" / "run")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
