"""What a run says at its start (model, data, run directory) and its end (best, checkpoints, next commands)."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from pathlib import Path

from pipeline.model.base import summary


def start_block(job, run_dir: Path) -> str:
    """The model's parameters per group (a tied alias noted, never counted twice), the data's size, the run."""
    model, data = job.state.model, job.state.dataset
    rows, total = summary(model.params, getattr(model, "aliases", {}))
    width = max([len(r[0]) for r in rows] + [5])
    tied = " (tied: counted once)" if getattr(model, "aliases", None) else ""
    lines = [f"model {type(model).__name__}: {total:,} parameters{tied}"]
    lines.append(f"  {'group':<{width}}  {'arrays':>6}  {'params':>10}  shape")
    for group, shapes, n, note in rows:
        biggest = "x".join(map(str, max(shapes, key=math.prod))) if shapes else "-"
        note = f"  {note}" if note else ""
        lines.append(f"  {group:<{width}}  {len(shapes):>6}  {n:>10,}  {biggest}{note}")
    spec, n = data.spec, data.n_train
    what = f"{n:,} train rows, {spec.n_features} features -> {spec.n_targets} targets"
    if spec.vocab_size:
        what = f"{n:,} train windows, {getattr(data, 'n_val', 0):,} val windows of"
        what += f" {spec.block_size} tokens, vocab {spec.vocab_size:,}"
    lines += [f"data {type(data).__name__}: {what}", f"run directory {run_dir}"]
    return "\n".join(lines)


# Hydra's flags that name the configs a run was composed from: a flag and its value, as `python -m pipeline` takes them
CONFIG_FLAGS = ("--config-dir", "--config-path", "--config-name")
DIR_FLAGS = ("--config-dir", "--config-path")
SEARCH = "hydra.searchpath="  # the override a run's own search path is given by
UI_QUERY = "?workflowType=machine_learning"  # mlflow 3's UI opens an experiment in its GenAI view without it
UI_LOCAL = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def tool_args(command: list[str]) -> list[str]:
    """The configs a tool opening the run's checkpoints needs of its `command`, as one `hydra.searchpath=[...]`:
    `--config-dir`/`--config-path`'s directories first (`file://`), then the run's own search path."""
    pairs = list(zip([None, *command], command))  # (the argument before, the argument)
    dirs = ["file://" + os.path.abspath(arg) for flag, arg in pairs if flag in DIR_FLAGS]
    given = [a for f, a in pairs if f not in CONFIG_FLAGS and a.lstrip("+").startswith(SEARCH)]
    searchpath = given[-1] if given else None
    if not dirs:
        return [searchpath] if searchpath else []
    from pipeline.config.targets import hydra_quoted, parse_overrides

    entries = []
    if searchpath:
        (parsed,) = parse_overrides([searchpath])
        entries = [str(e) for e in parsed.value()]
    return [f"hydra.searchpath=[{','.join(hydra_quoted(e) for e in [*dirs, *entries])}]"]


def ui_page(server: str, experiment_id: str | None) -> str:
    """The mlflow UI's page of the experiment (None: every one) at `server`, in its machine-learning view."""
    return f"{server.rstrip('/')}/#/experiments{'/' + experiment_id if experiment_id else ''}{UI_QUERY}"


def ui_server(tracking_uri: str) -> str:
    """Where the UI of the store at `tracking_uri` is: a tracking server's own address, else `mlflow ui`'s."""
    return tracking_uri if tracking_uri.startswith(("http://", "https://")) else UI_LOCAL


def ui_command(tracking_uri: str) -> str:
    """The shell command that serves the UI of a store without a server (quoted: a path may hold spaces)."""
    return shlex.join(["mlflow", "ui", "--backend-store-uri", tracking_uri])


def run_page(run_uri: str) -> str:
    """The mlflow UI's page (machine-learning view) of a run URI `<store>#/experiments/<id>/runs/<id>`."""
    store, sep, route = run_uri.partition("#")
    if not sep or not route.startswith("/experiments/"):
        return run_uri
    return f"{ui_server(store).rstrip('/')}/#{route}{UI_QUERY}"


def end_block(
    *,
    status: str,
    step: int,
    run_dir: Path,
    best: tuple | None,
    links: dict[str, Path | None],
    curve: Path | None,
    run_uri: str | None,
    tracking_uri: str | None,
    overrides: list[str],
    samples: bool,
    experiment_id: str | None = None,
    resume: list[str] | None = None,
) -> str:
    """At most 12 lines: where the run ended, its best, checkpoints, curve, index, and the next commands, each as
    it runs pasted in the same shell (`resume`: run/plan.continued_by; None: `overrides`; []: none)."""
    # `python` if that is the one on PATH
    py, found = sys.executable or "python", shutil.which("python")
    same = found and os.path.realpath(found) == os.path.realpath(py)
    if os.path.basename(py) == "python" and same:
        py = "python"
    # the PYTHONPATH this process was given, absolute: a package of your own is found by the lines pasted, also
    # where PYTHONPATH was set for the one command (`PYTHONPATH=examples/moons python -m pipeline ...`)
    given = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    path = os.pathsep.join(os.path.abspath(p) for p in given if p)
    py = f"PYTHONPATH={shlex.quote(path)} {shlex.quote(py)}" if path else shlex.quote(py)
    lines = [f"{status} at step {step}: {run_dir}"]
    if best is not None:
        lines.append(f"  best        {best[0]}={best[1]:.6g} at step {best[2]}")
    ckpts = [f"{k}={Path(os.path.realpath(v)).name}" for k, v in links.items() if v is not None]
    root = next((Path(v).parent for v in links.values() if v is not None), None)
    lines.append(f"  checkpoints {root}/: {' '.join(ckpts)}" if ckpts else "  checkpoints none")
    lines.append(f"  curve       {curve if curve else 'none (nothing logged)'}")
    where = run_page(run_uri) if run_uri else "not indexed yet" if tracking_uri else "not tracked"
    lines.append(f"  mlflow      {where}")
    resume = overrides if resume is None else resume
    again = f"{py} {shlex.join(['-m', 'pipeline', *resume])}" if resume else None
    # complete: says so, exits 0
    lines.append(f"  resume      {again or 'none (resume=never: a new run each time)'}")
    target = links.get("best") or links.get("final") or links.get("newest")
    if target is not None:
        for tool, then in [("evaluate", ""), ("sample", ' prompt=""')][: 1 + samples]:
            command = shlex.join(["-m", f"pipeline.{tool}", str(target), *tool_args(overrides)])
            lines.append(f"  {tool:<12}{py} {command}{then}")
    if tracking_uri and ui_server(tracking_uri) == tracking_uri:  # a server's UI: its address
        lines.append(f"  mlflow ui   {ui_page(tracking_uri, experiment_id)}")
    elif tracking_uri:
        lines.append(f"  mlflow ui   {ui_command(tracking_uri)}")
        lines.append(f"  then open   {ui_page(UI_LOCAL, experiment_id)}")
    return "\n".join(lines)
