"""stages.best_val.keep=k (the k best checkpoints by monitor, Lightning's save_top_k) and stages.best_val.filename
(a link beside step-* per kept checkpoint, named by its values), end to end on kernodeck (6 updates an epoch):
the kept set against an oracle computed from the run's own metrics.jsonl, through preemptions and kills."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import (
    KERNODECK,
    PROJECT_ROOT,
    kept,
    metrics,
    refused_in_one_line,
    run_job,
    run_pipeline,
    the_run,
)

from pipeline.run.directory import RunDir
from pipeline.stages.best import BestVal

# evaluations every 2 updates, a rotating checkpoint every epoch (6), 30 updates: 15 evaluations, 5 epochs
BASE = (*KERNODECK, "trainer.max_steps=30", "trainer.eval_every=2", "stages.rotate_last_3.keep=2")
PATTERN = "{step}-{val_loss:.4f}"
NAMED = (f"stages.best_val.filename='{PATTERN}'",)


def best_val(**kw) -> BestVal:
    return BestVal(
        **{"monitor": "m", "mode": "min", "order": 30, "keep": 1, "filename": None, **kw}
    )


def oracle(run, k: int, mode: str = "min") -> list[int]:
    """The k best evaluations' steps in the run's own metrics.jsonl, best first, the earlier of equals first."""
    sign = 1.0 if mode == "min" else -1.0
    evals = [(ln["val/loss"], ln["step"]) for ln in RunDir(run).read_metrics() if "val/loss" in ln]
    return [s for _, s in sorted(evals, key=lambda vs: (sign * vs[0], vs[1]))[:k]]


def steps(run) -> set[int]:
    return {s for s, _ in RunDir(run).store.steps()}


def test_keep_1_saves_the_state_it_always_saved_and_keep_k_adds_its_ranking():
    one = best_val()
    assert set(one.state_dict()) == {"best", "best_step", "monitor", "mode", "since"}
    three = best_val(keep=3)
    for step, v in ((1, 3.0), (2, 1.0), (3, math.nan), (4, 2.0), (5, 1.0), (6, 5.0)):
        three.wants_checkpoint(type("E", (), {"metrics": {"m": v}, "step": step})())
    assert three.state_dict()["top"] == [[1.0, 2], [1.0, 5], [2.0, 4]] and three.best_step == 2
    # a checkpoint of keep=1 resumed with keep=3: its one best begins the list; keep=3 resumed with keep=2: cut
    grown = best_val(keep=3)
    grown.load_state_dict(one.state_dict() | {"best": 1.5, "best_step": 7})
    assert grown.top == [(1.5, 7)]
    cut = best_val(keep=2)
    assert cut.fit_reason(three.state_dict()) is None
    cut.load_state_dict(three.state_dict())
    assert cut.top == [(1.0, 2), (1.0, 5)] and cut.policy().n == 2 and cut.link_policy().n == 1


@pytest.mark.parametrize(
    "top, words",
    [
        ([[2.0, 4], [1.0, 2]], "not ranked best first"),
        ([[1.0, 2], [1.0, 2]], "one entry a step"),
        ([[1.0, 3]], "does not begin with the best"),
        ([[math.inf, 2]], "not a list of"),
        ([[1.0, -1]], "not a list of"),
        ([["1", 2]], "not a list of"),
    ],
)
def test_a_saved_ranking_that_is_not_one_is_refused(top, words):
    with pytest.raises(ValueError, match=words):
        best_val(keep=3).check_state_dict(
            {"best": 1.0, "best_step": 2, "monitor": "m", "mode": "min", "top": top}
        )


def test_keep_and_filename_are_checked_in_one_line(tmp_path):
    for bad, words in (
        ("stages.best_val.keep=0", "stages.best_val.keep=0: must be a number >= 1"),
        ("stages.best_val.filename='a/{step}'", "stages.best_val.filename='a/{step}': makes 'a/0'"),
        ("stages.best_val.filename='{val_loss}'", "must contain {step}"),
        ("stages.best_val.filename='step-{step:08d}'", "not step-<digits>"),
        ("stages.best_val.filename='{step.__class__!r}'", "is not a metric or step"),
        # a field names a metric the run logs, as a monitor does, or the run names every link `10-none`
        (
            "stages.best_val.filename='{step}-{val/los:.3f}'",
            "stages.best_val.filename='{step}-{val/los:.3f}': field {val/los}: this run logs no such "
            "metric; did you mean val/loss?",
        ),
        (
            "stages.best_val.filename='{step}-{val/loss.__class__}'",
            "no attribute, index or conversion",
        ),
        ("stages.best_val.filename='{step}-{val/loss[0]}'", "no attribute, index or conversion"),
        # a name the pattern can make, with its link's temporary name 18 bytes longer, must fit 255
        (f"stages.best_val.filename='{{step}}-{'x' * 213}'", "makes names of up to 238 bytes"),
    ):
        line = refused_in_one_line([*BASE, bad, f"paths.output_dir={tmp_path / 'out'}"], tmp_path)
        assert words in line, line
        assert not (tmp_path / "out" / "runs").exists()


def test_the_longest_name_a_pattern_may_make_names_a_link_at_every_save(tmp_path):
    """The bound is exact: every name 237 bytes (a 24-digit step, the widest a field is written), its temporary
    name 255, and the run keeps it through its saves and a re-run (the pattern one byte longer: refused above)."""
    pattern = "{step:024d}-" + "x" * 212
    args = [
        *KERNODECK,
        "trainer.max_steps=6",
        f"stages.best_val.filename='{pattern}'",
        "stages.best_val.keep=2",
        f"paths.output_dir={tmp_path / 'out'}",
    ]
    for _ in range(2):
        assert run_job(*args)[0] == 0
    links = RunDir(the_run(tmp_path / "out")).store.links()
    named = {n for n in links if n not in ("best", "final")}
    assert named and all(len(n.encode()) == 237 and n.endswith("x" * 212) for n in named), links


@pytest.mark.parametrize("k, mode", [(1, "min"), (2, "max"), (3, "min")])
def test_a_run_keeps_the_k_best_of_its_own_evaluations_with_rotate_and_final(tmp_path, k, mode):
    out = tmp_path / "out"
    assert (
        run_job(
            *BASE,
            f"stages.best_val.keep={k}",
            f"stages.best_val.mode={mode}",
            *NAMED,
            f"paths.output_dir={out}",
        )[0]
        == 0
    )
    run = the_run(out)
    best = oracle(run, k, mode)
    assert steps(run) == {24, 30} | set(best)  # rotate's newest two (final is 30) and the k best
    store = RunDir(run).store
    assert store.link_step("best") == best[0] and store.link_step("final") == 30
    lines = {ln["step"]: ln for ln in RunDir(run).read_metrics()}
    names = {f"{s}-{lines[s]['val/loss']:.4f}": f"step-{s:08d}" for s in best}
    assert store.links() == {"best": f"step-{best[0]:08d}", "final": f"step-{30:08d}", **names}
    for name in names:  # relative links beside the step directories, each naming one that exists
        assert (
            os.readlink(store.root / name) == names[name]
            and (store.root / name / "manifest.json").is_file()
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "out"
    assert run_job(*BASE, "stages.best_val.keep=3", *NAMED, f"paths.output_dir={out}")[0] == 0
    return the_run(out)


def test_keep_3_preempted_twice_and_resumed_keeps_what_the_uninterrupted_run_keeps(
    tmp_path, preempt_at, uninterrupted
):
    from pipeline.run.signals import SIGNALS_STATE

    out = tmp_path / "out"
    for at in (9, 17, None):  # between evaluations, and on one that enters the top 3
        preempt_at(at)
        assert run_job(*BASE, "stages.best_val.keep=3", *NAMED, f"paths.output_dir={out}")[0] == (
            75 if at else 0
        )
        SIGNALS_STATE.received = None
    run = the_run(out)
    assert kept(run) == kept(
        uninterrupted
    )  # every kept checkpoint's bytes, and the links with their names
    assert metrics(run) == metrics(uninterrupted)
    assert oracle(uninterrupted, 3)[0] == RunDir(uninterrupted).store.link_step("best")


@pytest.mark.slow
@pytest.mark.parametrize("point", range(1, 40, 3))
def test_a_kill_at_any_save_point_loses_nothing_and_the_rerun_keeps_the_same_set(
    tmp_path, point, uninterrupted
):
    """SIGKILL inside a save or a retention (between the rename and the links, between a name's retirement
    and its step's deletion...), then the identical command: the same checkpoints and links as the run never
    killed, and no link ever names a missing step."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        *BASE,
        "stages.best_val.keep=3",
        *NAMED,
        f"paths.output_dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PIPELINE_CHAOS": f"save:{point}"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == -9, first.stderr[-2000:]
    store = RunDir(the_run(out)).store
    assert all((store.root / target).is_dir() for target in store.links().values())
    env.pop("PIPELINE_CHAOS")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert kept(the_run(out)) == kept(uninterrupted)


@pytest.mark.slow  # 17 real processes, 8 of them SIGKILLed
def test_chaos_mode_with_keep_3_and_named_links(tmp_path):
    r = run_pipeline(
        [
            "experiment=kernodeck",
            "tracking=none",
            "trainer.eval_every=1",
            "stages.best_val.keep=3",
            *NAMED,
            "verify.kill=random",
            "verify.trials=8",
            f"paths.output_dir={tmp_path}",
        ],
        tmp_path,
        module="pipeline.verify",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (report,) = [
        json.loads(p.read_text()) for p in (tmp_path / "verify").glob("*/chaos/verification.json")
    ]
    assert (
        report["trials"] == 8 and report["bit_exact"] == 8 and report["same_checkpoints_kept"] == 8
    )


@pytest.mark.parametrize(
    "step, metrics, name",
    [
        (12, {"val/loss": 1.23456}, "12-1.2346"),
        (12, {"val/loss": 2}, "12-2.0000"),  # an integer value takes the float format
        (12, {"val/loss": math.nan}, "12-nan"),
        (12, {"val/loss": math.inf}, "12-inf"),
        (12, {"val/loss": -math.inf}, "12--inf"),
        (12, {"val/loss": 1e300}, "12-1e+300"),
        (12, {"val/loss": -1e300}, "12--1e+300"),  # not 300 digits
        (12, {}, "12-none"),  # not measured at that step
    ],
)
def test_a_name_from_the_pattern_is_one_short_path_component_whatever_the_value(
    step, metrics, name
):
    from pipeline.files import names, patterns

    assert (
        patterns.render(PATTERN, step, metrics) == name and names.problem(name, reserve=0) is None
    )


def test_a_pattern_is_data_never_code():
    from pipeline.files import patterns

    # a field is a metric's name, never an attribute, an index or a conversion of a Python object
    assert patterns.render("{step}-{val.__class__}", 3, {"val.__class__": 1.5}) == "3-1.5"
    assert (
        patterns.problem("{step}-{m[0]}")
        and patterns.problem("{step!s}")
        and patterns.problem("{step:{w}}")
    )
    assert patterns.problem(
        "{step}-{val.__class__}"
    )  # attribute access: refused, though render reads it as a name
    assert patterns.problem("{step:.2f}")  # two steps could share a name
    assert (
        patterns.render("{step}" + "x" * 300, 3, {}) is None
    )  # too long for a file name: no link, no error


def test_a_config_written_before_keep_and_filename_still_validates_and_builds_with_one_best(
    tmp_path,
):
    """A checkpoint's config from before the keys (tools build its stages from it): keep 1, no names."""
    from conftest import config_of

    from pipeline.config.schemas import validate
    from pipeline.run.assemble import build_stages

    config = config_of(*KERNODECK, f"paths.output_dir={tmp_path}")
    for key in ("keep", "filename"):
        del config["stages"]["best_val"][key]
    validate(config)
    (best,) = [s for s in build_stages(config) if s.name == "best_val"]
    assert (
        best.keep == 1
        and best.named() is None
        and set(best.state_dict()) == set(best_val().state_dict())
    )
