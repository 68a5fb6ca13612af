"""An untrusted checkpoint decides no code (pipeline/config/targets.py, trained.restore_checkpoint): a manifest whose
hashes are recomputed after its config was made to name `builtins.open`, `shutil.copyfile`, `os.remove`,
`pathlib.Path.write_text` or a module of the attacker's own is refused by inspect, evaluate, sample, export_hf
and a resume from it -- exit 2, one line naming the checkpoint, the key and the target -- and nothing it
names is called or imported: the victim files, the sentinel and the whole tree around are byte-unchanged."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNODECK, PROJECT_ROOT, env_for_subprocess, run_job, the_run, tree

from pipeline.config import targets
from pipeline.config.identity import config_hash, semantic_hash

HINT = "which neither the pipeline's configs nor yours name (give your config directory with hydra.searchpath=[...]"
EVIL = "evil_module"  # the attacker's module on PYTHONPATH: writes the sentinel when imported
EVIL_SOURCE = """from pathlib import Path
Path(__file__).with_name("SENTINEL").write_text("imported")


class Model:
    def __init__(self, **kw):
        Path(__file__).with_name("SENTINEL").write_text("called")
"""


# -- the allowlist itself (no subprocess) ---------------------------------------------------------------


def test_the_shipped_targets_are_every_target_in_conf():
    oracle = set()
    for path in (PROJECT_ROOT / "conf").rglob("*.yaml"):
        oracle |= set(re.findall(r"^\s*_target_:\s*([\w.]+)\s*$", path.read_text(), re.M))
    assert targets.shipped() == oracle and "pipeline.model.mlp.MLP" in oracle and len(oracle) >= 20


def test_your_search_path_adds_the_targets_of_its_files(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "_target_: mine.Net\nlayer:\n  _target_: mine.Layer\n"
    )
    (tmp_path / "top.yaml").write_text("nodes:\n  - _target_: mine.InAList\n")
    for entry in (str(tmp_path), f"file://{tmp_path}"):
        assert targets.allowed((f"hydra.searchpath=[{entry}]",)) - targets.shipped() == {
            "mine.Net",
            "mine.Layer",
            "mine.InAList",
        }
    assert targets.allowed(("data._target_=cli.Data",)) - targets.shipped() == {"cli.Data"}
    with pytest.raises(targets.ConfigError, match="not available"):
        targets.allowed((f"hydra.searchpath=[{tmp_path / 'nowhere'}]",))


ALLOWED = frozenset({"pipeline.model.mlp.MLP"})


@pytest.mark.parametrize(
    "config, key",
    [
        ({"model": {"_target_": "builtins.open"}}, "config.model._target_ names 'builtins.open'"),
        (
            {"model": {"_target_": "pipeline.model.mlp.MLP", "act": {"_target_": "os.remove"}}},
            "config.model.act._target_ names 'os.remove'",
        ),
        (
            {
                "model": {
                    "_target_": "pipeline.model.mlp.MLP",
                    "_args_": [1, {"_target_": "pathlib.Path"}],
                }
            },
            "config.model._args_[1]._target_ names 'pathlib.Path'",
        ),
        (
            {
                "model": {
                    "_target_": "pipeline.model.mlp.MLP",
                    "_args_": [[{"_target_": "os.remove"}]],
                }
            },
            "config.model._args_[0][0]._target_ names 'os.remove'",
        ),
        # a shipped class out of its place is code the config of a run never builds there
        (
            {"stages": {"x": {"_target_": "pipeline.model.mlp.MLP"}}},
            "config.stages.x._target_ names 'pipeline.model.mlp.MLP', a class the pipeline builds only under model",
        ),
        ({"verify": {"_target_": "pipeline.model.mlp.MLP"}}, "never under verify"),
        ({"_target_": "pipeline.model.mlp.MLP"}, "never under the top level"),
        (
            {"model": {"_target_": ["builtins.open"]}},
            "config.model._target_ is ['builtins.open'], not the name",
        ),
        (
            {
                "model": {
                    "_target_": "pipeline.model.mlp.MLP",
                    "hidden": "${oc.create:{_target_: builtins.open}}",
                }
            },
            "config.model.hidden holds the interpolation",
        ),
        (
            {"model": {"_target_": "${oc.decode:'builtins.open'}"}},
            "config.model._target_ holds the interpolation",
        ),
    ],
)
def test_check_walks_the_whole_tree(config, key):
    with pytest.raises(targets.UnknownTarget) as e:
        targets.check(config, ALLOWED)
    assert key in str(e.value) and "\n" not in str(e.value)
    targets.check(
        {"model": {"_target_": "pipeline.model.mlp.MLP", "hidden": [8], "x": [{"y": None}]}},
        ALLOWED,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, node",
    [
        (
            "stages.best_val",
            {
                "_target_": "pipeline.data.grammar.GrammarCorpus",
                "cache_dir": "{out}",
                "n_sentences": 50,
            },
        ),
        (
            "model",
            {
                "_target_": "pipeline.data.grammar.GrammarCorpus",
                "cache_dir": "{out}",
                "n_sentences": 50,
            },
        ),
        (
            "stages.rotate_last_3.cadence",
            {
                "_target_": "pipeline.tracking.mlflow_tracker.MlflowTracker",
                "uri": "sqlite:///{out}/mlflow.db",
            },
        ),
    ],
)
def test_a_shipped_class_out_of_its_place_is_refused(finished, tmp_path, key, node):
    """A corpus where a stage is built would write its cache where the checkpoint's `cache_dir` says."""
    scene = Scene(finished, tmp_path, "model", "builtins.open")
    chosen = tmp_path / "outside" / "chosen"
    node = json.loads(json.dumps(node).replace("{out}", str(chosen)))
    own = json.loads((the_run(finished) / "checkpoints" / "final" / "manifest.json").read_text())[
        "config"
    ]["model"]
    plant(
        scene.checkpoint, "model", own
    )  # the scene's planted model undone: only `node` is out of place
    plant(scene.checkpoint, key, node)
    scene.before = tree(tmp_path)
    proc = scene.run("pipeline.show", str(scene.checkpoint))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (
        proc.stdout + proc.stderr
    )
    assert (
        f"config.{key}._target_ names '{node['_target_']}', a class the pipeline builds only under"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not chosen.exists() and tree(tmp_path) == scene.before


def test_inspect_takes_only_a_search_path(tmp_path, capsys):
    from pipeline.cli import show as pinspect

    assert pinspect.main([str(tmp_path), "data.seed=3"]) == 2
    assert (
        capsys.readouterr().err
        == "pipeline.show: data.seed=3: only hydra.searchpath=[...] can be given here\n"
    )
    assert pinspect.main([str(tmp_path), f"hydra.searchpath=[{tmp_path / 'nowhere'}]"]) == 2
    assert "not available" in capsys.readouterr().err


# -- the real commands against planted manifests ------------------------------------------------------


FINISHED = (*KERNODECK, "trainer.max_steps=4")  # conftest's `finished`: one checkpoint, step 4


class Scene:
    """A copy of the finished run whose checkpoint's config names `node` at `key`, the victim files, and the
    attacker's module (importable by every command run here)."""

    def __init__(self, finished: Path, tmp: Path, key: str, target: str):
        self.tmp = tmp
        self.out = tmp / "out"
        shutil.copytree(finished, self.out, symlinks=True)
        self.checkpoint = the_run(self.out) / "checkpoints" / "final"
        self.victim, self.created = tmp / "outside" / "victim.txt", tmp / "outside" / "created.txt"
        self.victim.parent.mkdir()
        self.victim.write_text("precious\n")
        self.evil = tmp / "attacker"
        self.evil.mkdir()
        (self.evil / f"{EVIL}.py").write_text(EVIL_SOURCE)
        self.sentinel = self.evil / "SENTINEL"
        self.key, self.target = key, target
        plant(self.checkpoint, key, self.node(target))
        (tmp / "cwd").mkdir()
        self.before = tree(tmp)

    def node(self, target: str) -> dict:
        v, c = str(self.victim), str(self.created)
        return {
            "builtins.open": {"_target_": "builtins.open", "file": v, "mode": "w"},
            "shutil.copyfile": {"_target_": "shutil.copyfile", "src": v, "dst": c},
            "os.remove": {"_target_": "os.remove", "path": v},
            "pathlib.Path.write_text": {
                "_target_": "pathlib.Path.write_text",
                "self": v,
                "data": "pwned",
            },
            f"{EVIL}.Model": {"_target_": f"{EVIL}.Model"},
        }[target]

    def run(self, module: str, *args: str) -> subprocess.CompletedProcess:
        env = env_for_subprocess()
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(self.evil)])
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=self.tmp / "cwd",
            env=env,
            capture_output=True,
            text=True,
        )

    def refused(self, proc: subprocess.CompletedProcess, module: str) -> None:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"{module}: ") and "Traceback" not in proc.stderr
        assert f"config.{self.key}._target_ names '{self.target}', {HINT}" in proc.stderr
        assert (
            self.victim.read_text() == "precious\n"
            and not self.created.exists()
            and not self.sentinel.exists()
        )
        assert tree(self.tmp) == self.before  # nothing written, removed or touched anywhere around


def plant(checkpoint: Path, key: str, node: dict) -> None:
    """Put `node` at `key` of the manifest's config and recompute both of its hashes: it passes every check
    a manifest has of itself."""
    path = checkpoint / "manifest.json"
    m = json.loads(path.read_text())
    *parents, leaf = key.split(".")
    parent = m["config"]
    for p in parents:
        parent = parent[p]
    assert leaf in parent
    parent[leaf] = copy.deepcopy(node)
    m["config_hash"] = config_hash(m["config"])
    m["semantic_config_hash"] = semantic_hash(m["config"], m["sources"])
    path.write_text(json.dumps(m))


TARGETS = (
    "builtins.open",
    "shutil.copyfile",
    "os.remove",
    "pathlib.Path.write_text",
    f"{EVIL}.Model",
)
KEYS = (
    "model",
    "data",
    "optimizer",
    "scheduler",
    "stages.best_val",
    "stages.rotate_last_3.cadence",
)
TOOLS = {
    "pipeline.show": (),
    "pipeline.evaluate": (),
    "pipeline.sample": ("prompt=a",),
    "pipeline.export_hf": ("{tmp}/hf",),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_inspect_refuses_every_target(finished, tmp_path, target):
    scene = Scene(finished, tmp_path, "model", target)
    scene.refused(scene.run("pipeline.show", str(scene.checkpoint)), "pipeline.show")
    scene.refused(
        scene.run("pipeline.show", str(scene.checkpoint.parent.parent), "--json"), "pipeline.show"
    )


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS[1:])
def test_inspect_refuses_it_under_every_node(finished, tmp_path, key):
    scene = Scene(finished, tmp_path, key, "builtins.open")
    scene.refused(scene.run("pipeline.show", str(scene.checkpoint)), "pipeline.show")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["builtins.open", f"{EVIL}.Model"])
@pytest.mark.parametrize("module", [m for m in TOOLS if m != "pipeline.show"])
def test_every_tool_refuses_it(finished, tmp_path, module, target):
    scene = Scene(
        finished, tmp_path, "model" if target == "builtins.open" else "stages.best_val", target
    )
    args = [a.format(tmp=tmp_path) for a in TOOLS[module]]
    scene.refused(scene.run(module, str(scene.checkpoint), *args), module)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["shutil.copyfile", f"{EVIL}.Model"])
def test_a_resume_from_it_builds_nothing_it_names(finished, tmp_path, target):
    """A resume builds the current config and compares: a planted model is drift, refused before anything."""
    scene = Scene(finished, tmp_path, "model", target)
    proc = scene.run(
        "pipeline",
        *KERNODECK,
        "trainer.max_steps=6",
        f"paths.output_dir={scene.out}",
        f"resume.source={scene.checkpoint}",
        "resume.allow_changes=[trainer.max_steps]",
        "hydra/job_logging=disabled",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "refusing to resume" in proc.stderr
    assert f"model._target_: '{target}' -> 'pipeline.model.mlp.MLP'" in proc.stderr
    assert (
        scene.victim.read_text() == "precious\n"
        and not scene.created.exists()
        and not scene.sentinel.exists()
    )
    assert tree(tmp_path) == scene.before


@pytest.mark.slow
def test_a_resume_never_builds_a_planted_stage(finished, tmp_path):
    """Stages are not semantic (no drift): the resumed run restores their state into its own stages."""
    scene = Scene(finished, tmp_path, "stages.best_val", f"{EVIL}.Model")
    proc = scene.run(
        "pipeline",
        *KERNODECK,
        "trainer.max_steps=6",
        f"paths.output_dir={tmp_path / 'new'}",
        f"resume.source={scene.checkpoint}",
        "resume.allow_changes=[trainer.max_steps]",
        "hydra/job_logging=disabled",
    )
    assert proc.returncode == 0, proc.stderr
    assert not scene.sentinel.exists() and scene.victim.read_text() == "precious\n"
    assert tree(scene.out) == {
        k[len("out/") :]: v for k, v in scene.before.items() if k.startswith("out/")
    }


@pytest.mark.slow
def test_its_own_search_path_lets_the_users_classes_through(finished, tmp_path):
    """The same planted class is built when the user's own config directory names it (the user's choice)."""
    scene = Scene(finished, tmp_path, "stages.best_val", f"{EVIL}.Model")
    (tmp_path / "myconf").mkdir()
    (tmp_path / "myconf" / "evil.yaml").write_text(f"_target_: {EVIL}.Model\n")
    proc = scene.run(
        "pipeline.show", str(scene.checkpoint), f"hydra.searchpath=[file://{tmp_path / 'myconf'}]"
    )
    assert (
        scene.sentinel.read_text() == "called"
    )  # now it is built: nothing else decided against it
    assert (
        proc.returncode == 1 and "INVALID" in proc.stdout
    )  # and it holds no stage state: does not fit


# -- nor where a tool writes, nor which of your files it reads --------------------------------------------


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny finished data=text run: (its output directory, the text file it was trained on)."""
    from conftest import text_overrides

    tmp = tmp_path_factory.mktemp("untrusted-text")
    (tmp / "a.txt").write_text("Abc de,\nfg he.\n" * 60)
    out = tmp / "out"
    assert run_job(*text_overrides(tmp / "a.txt"), f"paths.output_dir={out}")[0] == 0
    return out, tmp / "a.txt"


def planted_copy(out: Path, tmp: Path, key: str, value) -> Path:
    shutil.copytree(out, tmp / "out", symlinks=True)
    checkpoint = the_run(tmp / "out") / "checkpoints" / "final"
    plant(checkpoint, key, value)
    return checkpoint


def test_a_checkpoint_does_not_choose_where_the_corpus_cache_goes(text_run, tmp_path):
    out, _ = text_run
    elsewhere = tmp_path / "elsewhere"
    checkpoint = planted_copy(out, tmp_path, "paths.output_dir", str(elsewhere))
    shutil.rmtree(tmp_path / "out" / "data")  # the tool must build the corpus again: where?
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.evaluate", str(checkpoint)],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        not elsewhere.exists() and (tmp_path / "out" / "data").is_dir()
    )  # beside the run, as it was made


def test_a_checkpoint_does_not_choose_which_of_your_files_is_read(text_run, tmp_path):
    out, _ = text_run
    private = tmp_path / "private.txt"
    private.write_text(
        "a secret the checkpoint would like tokenized into a cache it can name\n" * 20
    )
    checkpoint = planted_copy(out, tmp_path, "data.path", str(private))
    before = tree(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.evaluate", str(checkpoint)],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        f"data.path={private} (the checkpoint's): not the file" in proc.stderr
        and "data.path=FILE" in proc.stderr
    )
    assert tree(tmp_path) == before  # no corpus of it cached anywhere
    # sample reads no data at all (the vocabulary is the checkpoint's data.json): the planted path is never opened
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.sample",
            str(checkpoint),
            "prompt=Abc",
            "max_new_tokens=3",
        ],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("Abc"), proc.stderr
    assert tree(tmp_path) == before


def test_the_corpus_cache_is_beside_the_run_never_inside_an_archive(tmp_path):
    from pipeline.config.compose import default_output_dir
    from pipeline.run.trained import cache_home

    step = tmp_path / "out" / "runs" / "r-0123" / "checkpoints" / "step-00000004"
    assert cache_home(step) == str(tmp_path / "out")
    (tmp_path / "out" / "recovery.json").parent.mkdir(parents=True)
    (tmp_path / "out" / "recovery.json").write_text(
        "{}"
    )  # pipeline.cli.archive's DEST: kept as it was checked
    assert cache_home(step) == default_output_dir()
    assert cache_home(tmp_path / "lone" / "step-00000004") == default_output_dir()


@pytest.mark.slow
def test_a_checkpoint_stuffed_with_files_is_refused_at_the_first_stranger(
    finished, tmp_path, monkeypatch
):
    """A million planted files in a checkpoint cost one entry each of the scan that meets them, not a table."""
    from pipeline.checkpoint import directory
    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.checkpoint.errors import CheckpointError

    checkpoint = tmp_path / "step-00000004"
    shutil.copytree(the_run(finished) / "checkpoints" / "final", checkpoint)
    for i in range(200):
        (checkpoint / f"junk-{i:04d}").write_text("")
    seen, real = [], os.scandir

    class Counted:
        def __init__(self, path):
            self.it = real(path)

        def __enter__(self):
            return (seen.append(e.name) or e for e in self.it.__enter__())

        def __exit__(self, *exc):
            return self.it.__exit__(*exc)

    monkeypatch.setattr(directory.os, "scandir", Counted)
    with pytest.raises(
        CheckpointError, match=r"junk-\d{4}: present but not listed in manifest.json"
    ):
        CheckpointDir(checkpoint).load({})
    assert len(seen) <= 6  # the five files of a checkpoint at most, then the first stranger


@pytest.mark.parametrize("module", ["pipeline.evaluate", "pipeline.sample"])
def test_a_planted_width_is_refused_before_the_model_is_built(finished, tmp_path, module):
    """10^12 parameters (4 TB, were they allocated) in a config whose weights file holds a few KB: one line, exit 2."""
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    checkpoint = the_run(out) / "checkpoints" / "final"
    plant(checkpoint, "model.hidden", [1_000_000, 1_000_000])
    (tmp_path / "cwd").mkdir()
    before = tree(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", module, str(checkpoint), *TOOLS[module]],
        cwd=tmp_path / "cwd",
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    assert (
        "describes a model of 1,000,0" in proc.stderr
        and "more than its weights file holds" in proc.stderr
    )
    assert tree(tmp_path) == before
