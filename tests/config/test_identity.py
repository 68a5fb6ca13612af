"""Run identity (pipeline/config/identity.py): what names a run directory, and what does not."""
from __future__ import annotations

import shutil

import pytest

from conftest import KERNODECK, TINY, config_of, run_job, the_run
from pipeline.config.identity import changed_keys, covered, run_name, semantic_config, semantic_hash
from pipeline.run.assemble import build


def test_the_output_directory_is_not_part_of_the_identity(tmp_path):
    """Regression (#10.5): data.output_dir used to interpolate paths.output_dir into the hashed config."""
    a = config_of(*TINY, f"paths.output_dir={tmp_path / 'a'}")
    b = config_of(*TINY, f"paths.output_dir={tmp_path / 'b'}", "tracking=mlflow", "trainer.log_every=7")
    assert run_name(a) == run_name(b)
    assert "paths" not in semantic_config(a) and "tracking" not in semantic_config(a)


def test_a_copied_output_directory_is_the_same_run(tmp_path):
    """Copying an output directory and re-running the command finds the run complete: no retraining."""
    assert run_job(*KERNODECK, f"paths.output_dir={tmp_path / 'a'}")[0] == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in the_run(tmp_path / "b").rglob("*.safetensors")}
    assert run_job(*KERNODECK, f"paths.output_dir={tmp_path / 'b'}")[0] == 0
    assert {p: p.stat().st_mtime_ns for p in the_run(tmp_path / "b").rglob("*.safetensors")} == before


def text_config(tmp_path, path: str) -> dict:
    return config_of("data=text", f"data.path={path}", "data.block_size=8", "model.n_layer=1", "model.n_embd=8",
                     "model.n_head=2", "tracking=none", f"paths.output_dir={tmp_path / 'out'}")


def test_a_text_file_is_identified_by_its_bytes_not_its_path(tmp_path, monkeypatch):
    """Regression (#10.5): the same file given relative and absolute made two runs; two files given by the
    same relative path from two directories collided."""
    for d, text in (("one", "abcdefgh" * 40), ("two", "hgfedcba" * 40)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "corpus.txt").write_text(text)
    monkeypatch.chdir(tmp_path / "one")
    relative = run_name(text_config(tmp_path, "corpus.txt"))
    absolute = run_name(text_config(tmp_path, str(tmp_path / "one" / "corpus.txt")))
    assert relative == absolute
    monkeypatch.chdir(tmp_path / "two")
    assert run_name(text_config(tmp_path, "corpus.txt")) != relative
    moved = tmp_path / "elsewhere.txt"
    shutil.copy(tmp_path / "one" / "corpus.txt", moved)
    assert run_name(text_config(tmp_path, str(moved))) == relative


def test_a_missing_text_file_is_one_line_naming_the_key(tmp_path):
    from pipeline.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data\.path=.*nope\.txt: No such file"):
        build(text_config(tmp_path, str(tmp_path / "nope.txt")))


def test_semantic_keys_change_the_name_and_others_do_not(tmp_path):
    base = config_of(*KERNODECK, f"paths.output_dir={tmp_path}")
    for override in ("optimizer.lr=0.05", "trainer.seed=1", "model.dropout=0", "trainer.batch_size=8"):
        assert run_name(config_of(*KERNODECK, f"paths.output_dir={tmp_path}", override)) != run_name(base)
    for override in ("stages.rotate_last_3.keep=5", "checkpoint.every_steps=2", "resume.allow_changes=[x]",
                     "verify.cut=3", "trainer.progress_bar=true"):
        assert run_name(config_of(*KERNODECK, f"paths.output_dir={tmp_path}", override)) == run_name(base)
    assert semantic_hash(base) == semantic_hash(dict(base))


def test_changed_keys_and_covered():
    assert changed_keys({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == {
        "a.c": (2, 3), "d": ("<absent>", 0)}
    assert covered("optimizer.lr", ["optimizer"]) and covered("optimizer.lr", ["optimizer.lr"])
    assert not covered("optimizer.lr", ["optim"]) and not covered("optimizer", ["optimizer.lr"])


def test_resume_never_gets_a_unique_directory_even_in_the_same_second(tmp_path):
    """Regression (#12.6): two resume=never runs started in the same second got the same directory."""
    cfg = config_of(*KERNODECK, f"paths.output_dir={tmp_path}", "resume=never")
    names = {build(cfg).run_dir.name for _ in range(5)}
    assert len(names) == 5 and all(n.startswith(run_name(cfg)) for n in names)
