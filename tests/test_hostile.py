"""Hostile input, catalogued: damaged and oversized checkpoint files, planted symlinks, bad values,
non-finite runs, signals during start-up and during saves. Each case runs the real command in a subprocess
and asserts its exit code, one line without a traceback naming the thing at fault, the child's peak RSS,
and a byte-for-byte unchanged tree outside the run directory (and inside it, for refused inputs)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import KERNODECK, TINY, env_for_subprocess, relist, the_run, tree
from safetensors.numpy import load_file, save_file

pytestmark = pytest.mark.slow
RSS_BOUND_MB = (
    450  # a legitimate kernodeck run peaks near 150 MB: no input may make us allocate much more
)


@dataclass
class Case:
    name: str
    code: int
    words: tuple[str, ...]
    plant: Callable | None = None  # plant(out, run, victim, tmp) -> extra args (or None)
    args: tuple = ()
    module: str = "pipeline"
    refused: bool = True  # the run directory must be byte-for-byte unchanged too
    env: dict = field(default_factory=dict)
    base: tuple = KERNODECK


# -- helpers that damage a copy of a finished run ------------------------------------------------------


def step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step-{n:08d}"


def edit_json(name: str, change):
    """Step 10's `name` changed by `change`; any file but the manifest relisted in it, so only its content lies."""

    def plant(out, run, victim, tmp):
        p = step(run, 10) / name
        data = json.loads(p.read_text())
        change(data)
        p.write_text(json.dumps(data))
        if name != "manifest.json":
            relist(step(run, 10), name)
        return inspect_final(run)

    return plant


edit_manifest = functools.partial(edit_json, "manifest.json")


def rehashed(change):
    """The manifest's config changed and both of its hashes recomputed: it passes every check of itself."""

    def plant(out, run, victim, tmp):
        from pipeline.config.identity import config_hash, semantic_hash

        p = step(run, 10) / "manifest.json"
        m = json.loads(p.read_text())
        change(m["config"])
        m["config"] = json.loads(
            json.dumps(m["config"]).replace("{tmp}", str(tmp))
        )  # a path in the checked tree
        m["config_hash"], m["semantic_config_hash"] = (
            config_hash(m["config"]),
            semantic_hash(m["config"], m["sources"]),
        )
        p.write_text(json.dumps(m))
        return inspect_final(run)

    return plant


def inspect_final(run: Path) -> tuple:
    return (str(step(run, 10)),)


def write_file(name: str, data: bytes, relisted: bool = True):
    def plant(out, run, victim, tmp):
        (step(run, 10) / name).write_bytes(data)
        if relisted:
            relist(step(run, 10), name)
        return inspect_final(run)

    return plant


def sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def header_file(header, extra: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + extra


def link_to_victim(rel: str):
    def plant(out, run, victim, tmp):
        target = run / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.symlink(victim, target)

    return plant


def link_output_entry(entry: str, dangling: bool = False):
    """<output_dir>/<entry> replaced by a link to the directory holding the victim (or a dangling one beside it)."""

    def plant(out, run, victim, tmp):
        target = out / entry
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.symlink(victim.parent / "new.db" if dangling else victim.parent, target)

    return plant


def resume_from(n: int = 10):
    def plant(out, run, victim, tmp):
        return (
            "trainer.max_steps=12",
            f"resume.source={step(run, n)}",
            "resume.allow_changes=[trainer.max_steps]",
        )

    return plant


def then(*plants):
    def plant(out, run, victim, tmp):
        args = ()
        for p in plants:
            args = p(out, run, victim, tmp) or args
        return args

    return plant


def text_file(content: bytes):
    def plant(out, run, victim, tmp):
        (tmp / "t.txt").write_bytes(content)
        return (
            "data=text",
            f"data.path={tmp / 't.txt'}",
            "data.block_size=8",
            "model.n_embd=8",
            "model.n_head=2",
            "model.n_layer=1",
        )

    return plant


def manifest_text(change):
    """manifest.json's text changed as text (what json.dumps cannot write: a key twice, 1e999)."""

    def plant(out, run, victim, tmp):
        p = step(run, 10) / "manifest.json"
        p.write_text(change(p.read_text()))
        return inspect_final(run)

    return plant


def lying_files_table(text: str) -> str:
    lie = {name: {"size": 1, "sha256": "0" * 64} for name in json.loads(text)["files"]}
    return (
        '{"files": ' + json.dumps(lie) + ", " + text.lstrip()[1:]
    )  # Python's json keeps the last table


def edit_optim(change):
    def plant(out, run, victim, tmp):
        p = step(run, 10) / "optim.safetensors"
        arrays = load_file(str(p))
        change(arrays)
        p.unlink()
        save_file(arrays, str(p), metadata={"format": "np"})
        relist(step(run, 10), "optim.safetensors")
        return inspect_final(run)

    return plant


edit_extra = functools.partial(edit_json, "extra.json")


def not_a_permutation(arrays: dict) -> None:
    """afe8033's form (its iterator's permutation of kernodeck's 24 rows in optim.safetensors), one id twice."""
    perm = np.arange(24, dtype=np.int64)
    perm[0] = perm[1]
    arrays["data_iter/permutation"] = perm


def afe8033_iterator(not_a_permutation):
    """The iterator's state as afe8033 wrote it (no `start` in extra.json), its permutation not one."""
    return then(edit_extra(lambda e: e["data_iter"].pop("start")), edit_optim(not_a_permutation))


def best_outside(*args: str):
    """`best` pointing at a valid copy of step 10 outside the run: only the link is wrong."""

    def plant(out, run, victim, tmp):
        elsewhere = tmp / "elsewhere" / "step-00000010"
        shutil.copytree(step(run, 10), elsewhere)
        (run / "checkpoints" / "best").unlink()
        os.symlink(elsewhere, run / "checkpoints" / "best")
        best = str(run / "checkpoints" / "best")
        return tuple(a.format(best=best, tmp=tmp) for a in args)

    return plant


def edit_run_file(name: str, change, inspected: bool = False):
    def plant(out, run, victim, tmp):
        (run / name).write_text(change((run / name).read_text()))
        return (str(run),) if inspected else None

    return plant


OUT_OF_RUN = (
    "checkpoints/best: is a symlink to",
    "elsewhere/step-00000010",
    "out of its run's checkpoints/",
)
SHOW = "pipeline.show"
CASES = [
    # manifest.json
    Case(
        "manifest-missing",
        1,
        ("manifest.json", "missing"),
        then(
            write_file("manifest.json", b"", False),
            lambda o, r, v, t: (step(r, 10) / "manifest.json").unlink(),
        ),
        module=SHOW,
    ),
    Case(
        "manifest-500MB",
        1,
        ("manifest.json", "over the", "limit"),
        lambda o, r, v, t: (sparse(step(r, 10) / "manifest.json", 500 << 20), inspect_final(r))[1],
        module=SHOW,
    ),
    Case(
        "manifest-deep",
        1,
        ("manifest.json", "nested deeper"),
        write_file("manifest.json", b"[" * 200000 + b"]" * 200000, False),
        module=SHOW,
    ),
    Case(
        "manifest-not-json",
        1,
        ("manifest.json", "not valid JSON"),
        write_file("manifest.json", b"{x", False),
        module=SHOW,
    ),
    Case(
        "manifest-bare-nan",
        1,
        ("manifest.json", "NaN"),
        write_file("manifest.json", b'{"schema_version": "2.0", "step": NaN}', False),
        module=SHOW,
    ),
    Case(
        "manifest-config-edited",
        1,
        ("manifest.json", "config_hash"),
        edit_manifest(lambda m: m["config"]["optimizer"].__setitem__("lr", 9.0)),
        module=SHOW,
    ),
    Case(
        "manifest-old-schema",
        1,
        ("manifest.json", "schema_version '1.0'", "'2.0'"),
        edit_manifest(lambda m: m.__setitem__("schema_version", "1.0")),
        module=SHOW,
    ),
    Case(
        "manifest-escaping-file",
        1,
        ("manifest.json", "invalid file name"),
        edit_manifest(lambda m: m["files"].__setitem__("../../victim", m["files"]["extra.json"])),
        module=SHOW,
    ),
    Case(
        "manifest-seed-edited",
        1,
        ("manifest.json", "seed"),
        edit_manifest(lambda m: m.__setitem__("seed", 1)),
        module=SHOW,
    ),
    Case(
        "manifest-duplicate-files",
        1,
        ("manifest.json", "duplicate key 'files'"),
        manifest_text(lying_files_table),
        module=SHOW,
    ),
    Case(
        "manifest-metric-1e999",
        1,
        ("manifest.json", "number 1e999 is out of range"),
        manifest_text(lambda t: t.replace('"metrics": {', '"metrics": {"val/huge": 1e999, ', 1)),
        module=SHOW,
    ),
    Case(
        "manifest-step-edited",
        1,
        ("manifest.json", "step 11 differs from progress.step 10 of extra.json"),
        edit_manifest(lambda m: m.__setitem__("step", 11)),
        module=SHOW,
    ),
    Case(
        "manifest-config-out-of-range",
        1,
        ("manifest.json", "a run refuses", "model.hidden=[0]"),
        rehashed(lambda c: c["model"].__setitem__("hidden", [0])),
        module=SHOW,
    ),
    Case(
        "manifest-corpus-as-stage",
        2,
        (
            "manifest.json",
            "config.stages.best_val._target_",
            "pipeline.data.grammar.GrammarCorpus",
            "only under data",
        ),
        rehashed(
            lambda c: c["stages"].__setitem__(
                "best_val",
                {
                    "_target_": "pipeline.data.grammar.GrammarCorpus",
                    "cache_dir": "{tmp}/chosen",
                    "n_sentences": 50,
                },
            )
        ),
        module=SHOW,
    ),
    # which file holds the damage: arrays in optim.safetensors, JSON values in extra.json
    Case(
        "optim-permutation",
        1,
        ("optim.safetensors", "data_iter", "not a permutation"),
        afe8033_iterator(not_a_permutation),
        module=SHOW,
    ),
    Case(
        "optim-moment-dtype",
        1,
        ("optim.safetensors", "exp_avg"),
        edit_optim(
            lambda a: a.__setitem__(
                k := next(n for n in a if "exp_avg/" in n), a[k].astype(np.float32)
            )
        ),
        module=SHOW,
    ),
    Case(
        "extra-counter",
        1,
        ("extra.json", "optimizer", "t=-1 is negative"),
        edit_extra(lambda e: e["optimizer"].__setitem__("t", -1)),
        module=SHOW,
    ),
    # extra.json
    Case(
        "extra-deep",
        1,
        ("extra.json", "nested deeper"),
        write_file("extra.json", b"[" * 200000 + b"]" * 200000),
        module=SHOW,
    ),
    Case(
        "extra-oversized",
        1,
        ("extra.json", "over the", "limit"),
        lambda o, r, v, t: (
            sparse(step(r, 10) / "extra.json", 100 << 20),
            relist(step(r, 10), "extra.json"),
            inspect_final(r),
        )[2],
        module=SHOW,
    ),
    Case(
        "extra-stage-state-type",
        1,
        ("extra.json", "stages", "does not fit"),
        lambda o, r, v, t: (
            lambda p: (
                p.write_text(
                    json.dumps(
                        {
                            **(e := json.loads(p.read_text())),
                            "stages": {**e["stages"], "best_val": {"best": "low", "best_step": 3}},
                        }
                    )
                ),
                relist(step(r, 10), "extra.json"),
                inspect_final(r),
            )[2]
        )(step(r, 10) / "extra.json"),
        module=SHOW,
    ),
    Case(
        "extra-rng-garbage",
        1,
        ("extra.json", "rng"),
        lambda o, r, v, t: (
            lambda p: (
                p.write_text(
                    json.dumps(
                        {
                            **(e := json.loads(p.read_text())),
                            "rng": {**e["rng"], "noise": {"state": "x" * 100000}},
                        }
                    )
                ),
                relist(step(r, 10), "extra.json"),
                inspect_final(r),
            )[2]
        )(step(r, 10) / "extra.json"),
        module=SHOW,
    ),
    Case(
        "extra-bitflip",
        1,
        ("extra.json", "sha256"),
        lambda o, r, v, t: (
            lambda p: (
                p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]),
                inspect_final(r),
            )[1]
        )(step(r, 10) / "extra.json"),
        module=SHOW,
    ),
    # safetensors files
    Case(
        "weights-oversized-header",
        1,
        ("weights.safetensors", "header of", "over the"),
        lambda o, r, v, t: (
            (step(r, 10) / "weights.safetensors").write_bytes(
                struct.pack("<Q", 1 << 40) + b" " * 64
            ),
            relist(step(r, 10), "weights.safetensors"),
            inspect_final(r),
        )[2],
        module=SHOW,
    ),
    Case(
        "weights-dtype-list",
        1,
        ("weights.safetensors", "dtype"),
        write_file(
            "weights.safetensors",
            header_file(
                {"layers.0.bias": {"dtype": ["F64"], "shape": [8], "data_offsets": [0, 64]}},
                b"\0" * 64,
            ),
        ),
        module=SHOW,
    ),
    Case(
        "weights-deep-header",
        1,
        ("weights.safetensors", "nested deeper"),
        write_file("weights.safetensors", header_file(b"[" * 100000 + b"]" * 100000)),
        module=SHOW,
    ),
    Case(
        "weights-truncated",
        1,
        ("weights.safetensors", "size"),
        lambda o, r, v, t: (
            (step(r, 10) / "weights.safetensors").write_bytes(
                (step(r, 10) / "weights.safetensors").read_bytes()[:-5]
            ),
            inspect_final(r),
        )[1],
        module=SHOW,
    ),
    Case(
        "weights-1000x",
        1,
        ("weights.safetensors", "more than a checkpoint of this config can hold"),
        lambda o, r, v, t: (
            sparse(step(r, 10) / "weights.safetensors", 600 << 20),
            relist(step(r, 10), "weights.safetensors"),
            inspect_final(r),
        )[2],
        module=SHOW,
    ),
    Case(
        "weights-other-shape",
        1,
        ("weights.safetensors", "does not fit"),
        write_file(
            "weights.safetensors",
            header_file(
                {"layers.0.bias": {"dtype": "F64", "shape": [9], "data_offsets": [0, 72]}},
                b"\0" * 72,
            ),
        ),
        module=SHOW,
    ),
    *(
        Case(
            f"{name.split('.')[0]}-symlink",
            1,
            (name, "symlink"),
            lambda o, r, v, t, name=name: (
                (step(r, 10) / name).unlink(),
                os.symlink(v, step(r, 10) / name),
                inspect_final(r),
            )[2],
            module=SHOW,
        )
        for name in ("weights.safetensors", "optim.safetensors")
    ),
    Case(
        "unlisted-file",
        1,
        ("notes.txt", "not listed"),
        lambda o, r, v, t: ((step(r, 10) / "notes.txt").write_text("x"), inspect_final(r))[1],
        module=SHOW,
    ),
    # the same damage met by a resume from that checkpoint: exit 2, nothing changed
    Case(
        "resume-from-deep-manifest",
        2,
        ("manifest.json", "nested deeper"),
        then(write_file("manifest.json", b"[" * 200000 + b"]" * 200000, False), resume_from()),
    ),
    Case(
        "resume-from-500MB-manifest",
        2,
        ("manifest.json", "limit"),
        lambda o, r, v, t: (
            sparse(step(r, 10) / "manifest.json", 500 << 20),
            resume_from()(o, r, v, t),
        )[1],
    ),
    Case(
        "resume-from-stage-type",
        2,
        ("extra.json", "does not fit"),
        then(
            lambda o, r, v, t: (
                lambda p: (
                    p.write_text(
                        json.dumps(
                            {
                                **(e := json.loads(p.read_text())),
                                "stages": {**e["stages"], "best_val": [1]},
                            }
                        )
                    ),
                    relist(step(r, 10), "extra.json"),
                )
            )(step(r, 10) / "extra.json"),
            resume_from(),
        ),
    ),
    Case(
        "resume-from-symlinked-weights",
        2,
        ("weights.safetensors", "symlink"),
        then(
            lambda o, r, v, t: (
                (step(r, 10) / "weights.safetensors").unlink(),
                os.symlink(v, step(r, 10) / "weights.safetensors"),
            ),
            resume_from(),
        ),
    ),
    Case(
        "resume-from-permutation",
        2,
        ("optim.safetensors", "not a permutation"),
        then(afe8033_iterator(not_a_permutation), resume_from()),
    ),
    # a link out of the run: refused by every tool
    Case("best-outside-inspect", 2, OUT_OF_RUN, best_outside("{best}"), module=SHOW),
    Case(
        "best-outside-evaluate", 2, OUT_OF_RUN, best_outside("{best}"), module="pipeline.evaluate"
    ),
    Case(
        "best-outside-sample",
        2,
        OUT_OF_RUN,
        best_outside("{best}", "prompt=a"),
        module="pipeline.sample",
    ),
    Case(
        "best-outside-export",
        2,
        OUT_OF_RUN,
        best_outside("{best}", "{tmp}/hf"),
        module="pipeline.export_hf",
    ),
    Case(
        "best-outside-resume",
        2,
        OUT_OF_RUN,
        best_outside(
            "trainer.max_steps=12",
            "resume.source={best}",
            "resume.allow_changes=[trainer.max_steps]",
        ),
    ),
    # the run's own files, met by the same command again
    Case(
        "metrics-duplicate-key",
        2,
        ("metrics.jsonl", "line 2: duplicate key 'step'"),
        edit_run_file(
            "metrics.jsonl",
            lambda t: t.replace('{"step": ', '{"step": 0, "step": ', 2).replace(
                '{"step": 0, "step": ', '{"step": ', 1
            ),
        ),
    ),
    Case(
        "metrics-1e999",
        2,
        ("metrics.jsonl", "line 1", "1e999"),
        edit_run_file("metrics.jsonl", lambda t: t.replace("{", '{"x": 1e999, ', 1)),
    ),
    Case(
        "metrics-600MB-line",
        2,
        ("metrics.jsonl", "line 11", "over the 1048576-byte limit of a line"),
        lambda o, r, v, t: (
            (r / "metrics.jsonl").open("ab").write(b'{"x": "' + b"a" * (600 << 20) + b'"}\n')
            and None
        ),
    ),
    Case(
        "run-json-duplicate-key",
        2,
        ("run.json", "duplicate key 'status'"),
        edit_run_file("run.json", lambda t: '{"status": "running", ' + t.lstrip()[1:]),
    ),
    Case(
        "run-json-duplicate-key-inspect",
        1,
        ("run.json", "duplicate key 'status'"),
        edit_run_file(
            "run.json", lambda t: '{"status": "running", ' + t.lstrip()[1:], inspected=True
        ),
        module=SHOW,
    ),
    # planted links in the run directory
    Case("link-at-lock", 2, (".lock", "symlink"), link_to_victim(".lock")),
    Case("link-at-run-json", 2, ("run.json", "symlink"), link_to_victim("run.json")),
    Case("link-at-metrics", 2, ("metrics.jsonl", "symlink"), link_to_victim("metrics.jsonl")),
    Case("link-at-log", 2, ("pipeline.log", "symlink"), link_to_victim("pipeline.log")),
    Case("link-at-hydra", 2, (".hydra", "symlink"), link_to_victim(".hydra")),
    Case("link-at-checkpoints", 2, ("checkpoints", "symlink"), link_to_victim("checkpoints")),
    Case(
        "dangling-step-link",
        2,
        ("step-00000006", "symlink"),
        lambda o, r, v, t: (shutil.rmtree(step(r, 6)), os.symlink(t / "nowhere", step(r, 6)))[1],
    ),
    Case(
        "step-link-outside",
        2,
        ("step-00000006", "symlink"),
        lambda o, r, v, t: (shutil.rmtree(step(r, 6)), os.symlink(v.parent, step(r, 6)))[1],
    ),
    Case(
        "old-temp-name-links",
        0,
        ("complete",),
        lambda o, r, v, t: (
            [os.symlink(v, r / n) for n in (".run.json.tmp", "metrics.jsonl.tmp")] and None
        ),
        refused=False,
    ),
    # links planted at an output directory's own entries: never followed (the output directory itself may be one)
    Case(
        "link-at-output-mlflow-db",
        2,
        ("mlflow.db", "symlink"),
        link_output_entry("mlflow.db", dangling=True),
        base=(*KERNODECK[:-2], "trainer.progress_bar=false"),
    ),
    Case(
        "link-at-output-mlartifacts",
        2,
        ("mlartifacts", "symlink"),
        link_output_entry("mlartifacts"),
        base=(*KERNODECK[:-2], "trainer.progress_bar=false"),
    ),
    Case("link-at-output-data", 2, ("data", "symlink"), link_output_entry("data"), base=TINY),
    Case("link-at-output-runs", 2, ("runs", "symlink"), link_output_entry("runs")),
    Case(
        "link-at-output-sweeps",
        2,
        ("sweeps", "symlink"),
        link_output_entry("sweeps"),
        base=("-m", *KERNODECK),
        args=("optimizer.lr=0.1,0.2",),
    ),
    # names that are not one directory's name: refused before anything is made
    Case("name-escaping", 2, ("name='../../escaped'", "'/'"), args=("name=../../escaped",)),
    Case("name-absolute", 2, ("name=", "'/'"), lambda o, r, v, t: (f"name={t}/outside/x",)),
    Case("name-300-chars", 2, ("name='nnn", "300 bytes"), args=("name=" + "n" * 300,)),
    Case("name-newline", 2, ("name='a\\nb'", "control characters"), args=("name='a\nb'",)),
    Case(
        "sweep-name-escaping",
        2,
        ("name='../../escaped'", "'/'"),
        base=("-m", *KERNODECK),
        args=("name=../../escaped", "optimizer.lr=0.1,0.2"),
    ),
    # bad values: no run directory, no traceback
    Case("batch-0", 2, ("trainer.batch_size=0",), args=("trainer.batch_size=0",)),
    Case("batch-negative", 2, ("trainer.batch_size=-2",), args=("trainer.batch_size=-2",)),
    Case(
        "batch-over-data", 2, ("trainer.batch_size=1000", "24"), args=("trainer.batch_size=1000",)
    ),
    Case("hidden-0", 2, ("model.hidden=[0]",), args=("model.hidden=[0]",)),
    Case(
        "negative-steps",
        2,
        ("trainer.max_steps=-5",),
        args=("trainer.max_steps=-5", "trainer.epochs=0"),
    ),
    Case(
        "nothing-to-train",
        2,
        ("trainer.max_steps=0", "trainer.epochs=0"),
        args=("trainer.max_steps=0", "trainer.epochs=0"),
    ),
    Case("negative-lr", 2, ("optimizer.lr=-1.0",), args=("optimizer.lr=-1",)),
    Case("betas-out-of-range", 2, ("optimizer.betas",), args=("optimizer.betas=[0.9,1.5]",)),
    Case("lr-not-a-number", 2, ("optimizer.lr=abc",), args=("optimizer.lr=abc",)),
    Case("unknown-key", 2, ("model.nonexistent",), args=("model.nonexistent=1",)),
    Case(
        "mlp-on-tokens",
        2,
        ("model=mlp", "data=regression"),
        args=("data=grammar", "data.n_sentences=300"),
    ),
    Case(
        "minigpt-on-rows",
        2,
        ("model=minigpt", "model=mlp"),
        args=("data=regression",),
        base=("tracking=none",),
    ),
    Case("text-without-path", 2, ("data.path",), args=("data=text",), base=("tracking=none",)),
    Case(
        "text-missing-file",
        2,
        ("data.path=", "No such file"),
        args=("data=text", "data.path=/nonexistent/x.txt"),
        base=("tracking=none",),
    ),
    Case(
        "text-not-utf8",
        2,
        ("not valid UTF-8",),
        text_file(b"\xff\xfe" * 500),
        base=("tracking=none",),
    ),
    Case("stage-mode", 2, ("mode",), args=("stages.best_val.mode=maximum",)),
    # non-finite numbers
    Case(
        "nan-loss-stops",
        1,
        ("step 14", "train/loss", "non-finite"),
        args=("scheduler.step_size=6", "scheduler.gamma=1e100", "trainer.max_steps=30"),
        refused=False,
    ),
    # signals during a save: a second signal changes nothing
    Case(
        "sigterm-sigint-in-save",
        75,
        ("preempted",),
        args=("trainer.max_steps=30",),
        env={"PIPELINE_CHAOS": "save:3:TERM+INT"},
        refused=False,
    ),
]


MEASURE = """
import os, sys
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[2:]], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256 if os.waitstatus_to_exitcode(status) >= 0 \
else 128 - os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case: Case, finished, tmp_path):
    assert len(CASES) >= 40
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    run = the_run(out)
    extra = (case.plant(out, run, victim, tmp_path) if case.plant else None) or ()
    args = (
        [*extra]
        if case.module != "pipeline"
        else [
            *case.base,
            *case.args,
            *extra,
            f"paths.output_dir={out}",
            "hydra/job_logging=disabled",
        ]
    )
    before_all = tree(tmp_path)
    runs_before = set((out / "runs").iterdir())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    err_path = tmp_path / "stderr.txt"
    rss_file = tmp_path / "maxrss.txt"
    with open(err_path, "w") as err, open(tmp_path / "stdout.txt", "w") as std:
        # A small process starts the command and measures it: a child forked from this (large) pytest
        # process would report pytest's memory as its own peak.
        p = subprocess.run(
            [sys.executable, "-c", MEASURE, str(rss_file), "-m", case.module, *args],
            cwd=cwd,
            stdout=std,
            stderr=err,
            env={**env_for_subprocess(), **case.env},
        )
    maxrss_kb = int(rss_file.read_text())
    rss_file.unlink()
    stderr, stdout = err_path.read_text(), (tmp_path / "stdout.txt").read_text()
    err_path.unlink()
    (tmp_path / "stdout.txt").unlink()
    assert p.returncode == case.code, f"exit {p.returncode}: {stderr[-3000:]}{stdout[-1000:]}"
    assert "Traceback" not in stderr + stdout, stderr
    said = [
        ln
        for ln in (stdout if case.module == SHOW and case.code == 1 else stderr).splitlines()
        if ln.strip()
    ]
    if case.code != 0:
        # inspect's verdict: its INVALID line (the last line for a checkpoint, the second for a run's run.json)
        message = (
            next((ln for ln in reversed(said) if "INVALID" in ln), said[-1])
            if case.module == SHOW and case.code == 1
            else "\n".join(said)
        )
        assert len(said) >= 1 and (case.module == SHOW or len(said) == 1), said
        for word in case.words:
            assert word in message, message
    assert maxrss_kb / 1024 < RSS_BOUND_MB, f"peak RSS {maxrss_kb / 1024:.0f} MB"
    assert victim.read_text() == "precious\n"
    cwd.rmdir()  # nothing written relative to the working directory
    if case.refused:
        assert tree(tmp_path) == before_all
    else:  # everything but the run directory it wrote is unchanged (a new one, or the finished one)
        written = (set((out / "runs").iterdir()) - runs_before) or {run}
        assert len(written) == 1
        (written,) = written
        assert tree(tmp_path, skip=written) == {
            k: v for k, v in before_all.items() if not (tmp_path / k).is_relative_to(written)
        }
