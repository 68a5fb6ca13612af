"""trainer.eval_at_start: an evaluation before the first update (nanoGPT's iter 0), logged at step 0 like any
other; off by default; a resumed run does not evaluate step 0 again, and the trajectory is unchanged."""

from __future__ import annotations

from conftest import TINY, config_of, kept, metrics, run_job, the_run

from pipeline.config.errors import EXIT_PREEMPTED
from pipeline.run.assemble import build_dataset, build_state
from pipeline.run.signals import SIGNALS_STATE
from pipeline.trainer.loop import validate


def test_an_evaluation_at_step_0_is_logged_and_changes_nothing_else(tmp_path, finished_job):
    plain = finished_job(*TINY)
    assert metrics(the_run(plain))[0]["step"] > 0  # off by default: today's behaviour
    out = tmp_path / "out"
    assert run_job(*TINY, "trainer.eval_at_start=true", f"paths.output_dir={out}")[0] == 0
    first, *rest = metrics(the_run(out))
    config = config_of(*TINY)
    data = build_dataset(config)
    state = build_state(config, data.spec, data.n_train, data)
    try:  # the oracle: the untrained model's validation, as the run's own evaluations compute it
        assert first == {"step": 0, "epoch": 0, **validate(state)}
    finally:
        state.runner.close()
    assert rest == metrics(the_run(plain))  # every update as without it
    assert kept(the_run(out))[0].keys() == kept(the_run(plain))[0].keys()


def test_a_resumed_run_does_not_evaluate_step_0_again(tmp_path, preempt_at, finished_job):
    args = (*TINY, "trainer.eval_at_start=true")
    ref, out = finished_job(*args), tmp_path / "out"
    preempt_at(5)
    assert run_job(*args, f"paths.output_dir={out}")[0] == EXIT_PREEMPTED
    SIGNALS_STATE.received = None
    preempt_at(None)
    assert run_job(*args, f"paths.output_dir={out}")[0] == 0
    lines = metrics(the_run(out))
    assert [ln["step"] for ln in lines].count(0) == 1
    assert lines == metrics(the_run(ref)) and kept(the_run(out)) == kept(the_run(ref))


def test_the_option_off_names_the_run_as_before_it_existed():
    from pipeline.config.identity import run_name

    config = config_of(*TINY)
    before = {
        **config,
        "trainer": {k: v for k, v in config["trainer"].items() if k != "eval_at_start"},
    }
    assert config["trainer"]["eval_at_start"] is False and run_name(before) == run_name(config)
    assert run_name(config) != run_name(config_of(*TINY, "trainer.eval_at_start=true"))
