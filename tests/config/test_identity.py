"""Run identity (pipeline/config/identity.py): what names a run directory, and what does not."""

from __future__ import annotations

import shutil

import pytest
from conftest import KERNODECK, PROJECT_ROOT, TINY, config_of, run_job, the_run

from pipeline.config.identity import (
    SOURCES,
    changed_keys,
    config_hash,
    covered,
    described,
    get,
    identify,
    run_name,
    semantic_config,
    semantic_hash,
    source_hashes,
)
from pipeline.run.job import build


def test_the_output_directory_is_not_part_of_the_identity(tmp_path):
    """Regression (#10.5): data.output_dir used to interpolate paths.output_dir into the hashed config."""
    a = config_of(*TINY, f"paths.output_dir={tmp_path / 'a'}")
    b = config_of(
        *TINY, f"paths.output_dir={tmp_path / 'b'}", "tracking=mlflow", "trainer.log_every=7"
    )
    assert run_name(a) == run_name(b)
    assert "paths" not in semantic_config(a, {}) and "tracking" not in semantic_config(a, {})


def test_a_copied_output_directory_is_the_same_run(tmp_path):
    """Copying an output directory and re-running the command finds the run complete: no retraining."""
    assert run_job(*KERNODECK, f"paths.output_dir={tmp_path / 'a'}")[0] == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in the_run(tmp_path / "b").rglob("*.safetensors")}
    assert run_job(*KERNODECK, f"paths.output_dir={tmp_path / 'b'}")[0] == 0
    assert {
        p: p.stat().st_mtime_ns for p in the_run(tmp_path / "b").rglob("*.safetensors")
    } == before


def text_config(tmp_path, path: str) -> dict:
    return config_of(
        "data=text",
        f"data.path={path}",
        "data.block_size=8",
        "model.n_layer=1",
        "model.n_embd=8",
        "model.n_head=2",
        "tracking=none",
        f"paths.output_dir={tmp_path / 'out'}",
    )


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
    for override in (
        "optimizer.lr=0.05",
        "trainer.seed=1",
        "model.dropout=0",
        "trainer.batch_size=8",
    ):
        assert run_name(
            config_of(*KERNODECK, f"paths.output_dir={tmp_path}", override)
        ) != run_name(base)
    for override in (
        "stages.rotate_last_3.keep=5",
        "checkpoint.every_steps=2",
        "resume.allow_changes=[x]",
        "verify.cut=3",
        "trainer.progress_bar=true",
    ):
        assert run_name(
            config_of(*KERNODECK, f"paths.output_dir={tmp_path}", override)
        ) == run_name(base)
    assert semantic_hash(base, {}) == semantic_hash(dict(base), {})


def test_changed_keys_and_covered():
    assert changed_keys({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == {
        "a.c": (2, 3),
        "d": ("<absent>", 0),
    }
    assert covered("optimizer.lr", ["optimizer"]) and covered("optimizer.lr", ["optimizer.lr"])
    assert not covered("optimizer.lr", ["optim"]) and not covered("optimizer", ["optimizer.lr"])


def test_identify_is_the_hashes_and_the_name_in_one_value_and_never_a_fresh_sibling(tmp_path):
    """One call, one frozen value: what the manifests carry of the config and the run directory's name."""
    config = config_of(*KERNODECK, f"paths.output_dir={tmp_path}")
    ident = identify(config)
    assert (ident.sources, ident.config_hash, ident.semantic_hash, ident.name) == (
        {},
        config_hash(config),
        semantic_hash(config, {}),
        run_name(config),
    )
    with pytest.raises(AttributeError, match="cannot assign"):
        ident.name = "other"  # type: ignore[misc]
    fresh = identify(config_of(*KERNODECK, f"paths.output_dir={tmp_path}", "resume=never"))
    assert (
        fresh.name.startswith(f"{ident.name}-")
        and fresh.name
        != identify(config | {"resume": {"source": "never", "allow_changes": []}}).name
    )


def test_resume_never_gets_a_unique_directory_even_in_the_same_second(tmp_path):
    """Regression (#12.6): two resume=never runs started in the same second got the same directory."""
    cfg = config_of(*KERNODECK, f"paths.output_dir={tmp_path}", "resume=never")
    names = {build(cfg).run_dir.name for _ in range(5)}
    assert len(names) == 5 and all(n.startswith(run_name(cfg)) for n in names)


# --- every leaf of every shipped config -----------------------------------------------------------------------
# The keys that may change without naming another run, each with why it leaves the math alone. Every other leaf
# of every shipped option must change the semantic hash: a key wrongly left out would let a changed model or
# schedule resume into the old run (drift compares the same semantic config) or share its name.
NOT_SEMANTIC = {
    "paths": "where the outputs go",
    "tracking": "how the run is indexed in mlflow; the manifests are the truth",
    "trainer.log_every": "how often metrics are logged, not what they are",
    "trainer.progress_bar": "how progress is shown",
    "trainer.threads": "threads running the same shards: byte-identical updates (trainer/parallel.py)",
    "trainer.max_time": "when the process checkpoints and exits for a requeue; the resumed run goes on bit for bit",
    "trainer.on_nonfinite": "whether a non-finite loss ends the run; the updates before it are the same",
    "trainer.profile": "whether the run times its phases: it reads clocks only",
    "resume": "whether and from what the run resumes, not what it computes",
    "stages": "when to evaluate (pure), checkpoint, keep and stop: never what an update computes",
    "checkpoint": "when checkpoints are written; a resume from any of them goes on bit for bit",
    "verify": "the verifier's own settings",
    "optimized_metric": "what a sweeper optimises across runs",
    "data.max_bytes": "a bound on the input file's size; the file's bytes are hashed (data.path)",
}


def shipped_configs(tmp_path) -> list[dict]:
    """Configs that between them use every option of every group under conf/ (plain, as the job sees them)."""
    conf = PROJECT_ROOT / "conf"
    top = {p.name for p in conf.iterdir() if p.is_dir()} - {
        "hydra"
    }  # hydra's node is not in the plain config
    groups = {
        str(d.relative_to(conf)): sorted(f.stem for f in d.glob("*.yaml"))
        for d in conf.rglob("*")
        if d.is_dir() and d.relative_to(conf).parts[0] in top
    }
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 20)
    experiments = groups.pop(
        "experiment"
    )  # an experiment overrides other groups: each composed on its own
    combos = [
        [f"experiment={e}", f"data.path={tmp_path / 'corpus.txt'}"]
        if e == "nanogpt_char_cpu"
        else [f"experiment={e}"]
        for e in experiments
    ]  # an experiment on your own text names it
    for i in range(
        max(len(options) for options in groups.values())
    ):  # the i-th option of every group at once
        combo = [
            f"{'' if '/' not in g else '+'}{g}={options[i % len(options)]}"
            for g, options in groups.items()
        ]
        if "data=text" in combo:
            combo.append(f"data.path={tmp_path / 'corpus.txt'}")
        combos.append(combo)
    used = {o for combo in combos for o in combo}
    assert all(
        f"{g}={o}" in used or f"+{g}={o}" in used for g, opts in groups.items() for o in opts
    )
    return [config_of(*combo, f"paths.output_dir={tmp_path / 'out'}") for combo in combos]


def leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every leaf; a list is one leaf."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def changed(key: str, value, tmp_path):
    """Another value of the leaf's type; a file key: another file with other bytes."""
    if key in SOURCES:
        (tmp_path / "other.txt").write_text("a different corpus. " * 20)
        return str(tmp_path / "other.txt")
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, list):
        return [*value, value[-1] if value else 1]
    assert value is None, (key, value)
    return 1


def with_leaf(config: dict, key: str, value) -> dict:
    import copy

    out = copy.deepcopy(config)
    *parents, leaf = key.split(".")
    node = out
    for p in parents:
        node = node[p]
    node[leaf] = value
    return out


def test_every_leaf_of_every_shipped_config_is_in_the_identity_unless_declared_not(tmp_path):
    """Regression (#29): model.n_layer or the whole scheduler left out of the hash went unnoticed."""
    wrong, seen = [], set()
    for config in shipped_configs(tmp_path):
        base = semantic_hash(config, source_hashes(config))
        for key, value in leaves(config):
            seen.add(key)
            other = with_leaf(config, key, changed(key, value, tmp_path))
            same = semantic_hash(other, source_hashes(other)) == base
            if same != covered(key, list(NOT_SEMANTIC)):
                wrong.append(f"{key}={value!r}: {'not ' if same else ''}in the identity")
    assert not wrong, "\n".join(wrong)
    assert {
        "model.n_layer",
        "scheduler.warmup_steps",
        "scheduler.gamma",
        "data.path",
    } <= seen  # the walk reached them
    assert [
        k for k in NOT_SEMANTIC if not any(covered(s, [k]) for s in seen)
    ] == []  # no stale entry


ADDED = {
    "model": ("bias", "gelu"),
    "optimizer": ("weight_decay_on",),
    "scheduler": ("warmup_offset",),
}


def test_a_key_added_at_its_old_behaviour_changes_no_run_name():
    # The names the code before these keys gave (the README's run directory among them): a run directory written
    # then is found by the identical command, and drift sees no change; a key set otherwise is a new identity.
    assert run_name(config_of("trainer.max_steps=64")) == "default-b28c52f1161c"
    assert run_name(config_of(*KERNODECK)) == run_name(config_of(*KERNODECK, "model.hidden=[8]"))
    now = config_of()
    before = {
        k: (
            {n: v for n, v in node.items() if n not in ADDED.get(k, ())}
            if isinstance(node, dict)
            else node
        )
        for k, node in now.items()
    }
    assert before["model"] != now["model"] and semantic_config(before, {}) == semantic_config(
        now, {}
    )
    for key in (
        "model.bias=false",
        "model.gelu=erf",
        "optimizer.weight_decay_on=matrices",
        "scheduler.warmup_offset=1",
    ):
        assert run_name(config_of(key)) != run_name(now), key
        old, new = semantic_config(before, {}), semantic_config(config_of(key), {})
        assert described(old, new) == [
            f"{key.split('=')[0]} {get(old, key.split('=')[0])!r} -> "
            f"{get(new, key.split('=')[0])!r}"
        ], key


def test_the_name_comes_from_conf_alone():
    """conf/config.yaml's `name: default` names a run; code holds no second default ('run') under it."""
    config = config_of(*TINY)
    assert run_name(config).startswith("default-")
    del config["name"]
    with pytest.raises(ValueError, match=r"^name=None: must be a non-empty string"):
        run_name(config)
