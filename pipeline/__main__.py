"""`python -m pipeline [overrides]`: the Hydra entry point; `python -m pipeline TOOL ...`: pipeline/cli/TOOL.py."""

import contextlib
import os
import re
import sys
from pathlib import Path

from pipeline import TOOLS
from pipeline.config.errors import ConfigError, Refusal, error_line, exit_code
from pipeline.run.signals import SIGNALS_STATE, exit_now, run_command

# what can make hydra.mode anything but None: an override, a config from elsewhere, or a config of ours that sets it
_MODE_FROM = re.compile(r"hydra\.mode|^\s*mode\s*:\s*['\"]?(run|multirun|1|2)\b", re.I | re.M)
_OTHER_CONFIGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def mode_is_the_command_lines(argv: list[str], conf_dir) -> bool:
    """True if `-m` alone decides run or multirun: neither `argv` nor a YAML under `conf_dir` sets hydra.mode."""
    from pipeline.files import reading
    from pipeline.files.limits import MAX_CONF_YAML

    if any(a.startswith((*_OTHER_CONFIGS, "hydra.searchpath")) or "hydra.mode" in a for a in argv):
        return False
    for f in Path(conf_dir).rglob("*.yaml"):
        try:
            text = reading.read_bytes(f, MAX_CONF_YAML).decode(errors="replace")
        except OSError:  # a link, a FIFO, a file over 1 MiB: left to Hydra's own way
            return False
        if _MODE_FROM.search(text):
            return False
    return True


@contextlib.contextmanager
def hydra_shortcuts(argv: list[str], conf_dir):
    """Hydra with this entry's two shortcuts for the one call that runs it (another Hydra goes its own way)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.core.object_type import ObjectType

    # Hydra's --help makes ~150 group lookups, each deep-copying every config: one per (config, overrides) serves all
    def get_group_options(
        self, group_name, results_filter=ObjectType.CONFIG, config_name=None, overrides=None
    ):
        repos = self.__dict__.setdefault("_pipeline_help_repos", {})
        key = (config_name, tuple(overrides or ()))
        if key not in repos:
            repos[key] = self._parse_overrides_and_create_caching_repo(config_name, list(key[1]))[1]
        return repos[key].get_group_options(group_name, results_filter)

    # Hydra composes the config once only to read hydra.mode (~0.9 s a start): where mode_is_the_command_lines, None
    replaced: list[tuple[type, str, object]] = []  # (owner, name, the method it puts there)
    helping = "get_group_options" in ConfigLoaderImpl.__dict__ and {"--help", "-h"} & {*argv}
    if helping and hasattr(ConfigLoaderImpl, "_parse_overrides_and_create_caching_repo"):
        replaced.append((ConfigLoaderImpl, "get_group_options", get_group_options))
    if mode_is_the_command_lines(argv, conf_dir) and "get_mode" in Hydra.__dict__:
        replaced.append((Hydra, "get_mode", lambda *_, **__: None))
    with contextlib.ExitStack() as undo:  # the methods as they were, however the call ends
        for owner, name, new in replaced:
            undo.callback(setattr, owner, name, owner.__dict__[name])
            setattr(owner, name, new)
        yield


def command_args(hydra_cfg, conf_dir) -> list[str]:
    """The arguments that compose this job's config again: Hydra's config options, searchpath and the overrides."""
    from pipeline.config.targets import as_given

    args = []
    for source in (s for s in hydra_cfg.runtime.config_sources if s.schema == "file"):
        if source.provider == "main" and Path(source.path).resolve() != Path(conf_dir).resolve():
            args += ["--config-path", source.path]
        elif source.provider == "command-line":
            args += ["--config-dir", source.path]
    if hydra_cfg.job.config_name != "config":
        args += ["--config-name", hydra_cfg.job.config_name]
    given = as_given(hydra_cfg.overrides.hydra)
    args += [o for o in given if o.lstrip("+").startswith("hydra.searchpath=")]
    return args + as_given(hydra_cfg.overrides.task)


def main() -> int | None:
    """The job's exit code; a multirun's is its sweep's (`SweepCallback.code`), each job's end in its record."""
    import hydra

    from pipeline.config.compose import CONFIG_DIR, register, to_plain
    from pipeline.config.targets import as_given

    register()
    # a composition error Hydra raises, not prints on several lines (exit 1): one line and exit 2 here
    report_own = "HYDRA_FULL_ERROR" not in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    started: list = []  # a job began; a single run's Outcome once it has ended

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
    def task(cfg) -> float | None:
        started.append(None)
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        from pipeline.run import job as app

        hydra_cfg = HydraConfig.get()
        sweep = None
        if hydra_cfg.mode == RunMode.MULTIRUN:  # a single run never imports the sweep's code
            from pipeline.sweep.callback import job_of

            sweep = job_of(hydra_cfg)
        try:
            config = to_plain(cfg)
        except OmegaConfBaseException as e:  # missing or unresolved: one line naming the key
            key = getattr(e, "full_key", None)
            hint = " (data=text needs data.path=FILE)" if key == "data.path" else ""
            line = f"bad config: {key + ': ' if key else ''}{str(e).splitlines()[0]}{hint}"
            # a Refusal passes Hydra, which writes a line of its own over a task's Exception
            raise Refusal(ConfigError(line)) from None
        overrides, command = as_given(hydra_cfg.overrides.task), command_args(hydra_cfg, CONFIG_DIR)
        outcome = app.main(config, overrides, OmegaConf.to_yaml(cfg), sweep, command)
        if sweep is not None and outcome.requeued:
            exit_now(outcome.code)  # submitit waits for the requeued job: this one leaves no result
        started[-1] = outcome if sweep is None else None
        return outcome.value

    try:
        with hydra_shortcuts(sys.argv[1:], CONFIG_DIR):
            task()
        if (ended := started.pop() if started else None) is not None:
            return ended.code
        return None if SIGNALS_STATE.launching is None else SIGNALS_STATE.launching.code
    except Exception as e:
        if SIGNALS_STATE.interrupted_start():
            raise  # the handler's exception, raised inside a library (composing, building), came out as another
        # the sweep this process launches ends here; its table and exit line printed, the exception is said
        sweep = SIGNALS_STATE.launching
        if sweep is not None and sweep.raised(e, bool(started)) is not None:
            return sweep.code
        if started or not report_own or exit_code(e) is not None:
            raise
        # Hydra refused to compose the jobs
        raise ConfigError(f"bad config or override: {error_line(e)}") from e


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        tool = sys.argv.pop(1)
        sys.argv[0] = f"pipeline.{tool}"
        # `python -m pipeline TOOL args`: pipeline/cli/TOOL.py's main, imported once the signals are ours
        run_command(f"pipeline.{tool}", f"pipeline.cli.{tool}")
    run_command("pipeline", main)
