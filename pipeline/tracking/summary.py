"""The table a sweep ends with (docs/tracking.md: Sweeps): a pure function of sweep.json and jobs/*.json."""
from __future__ import annotations

import math
from collections import Counter

from pipeline.files import jsonio

MAX_ROWS = 12  # with the header, the best and the parent lines: under 20 lines whatever the sweep's size
MAX_CELL = 24  # a swept value wider than this is cut (the job's run name has it whole)


def finite(objective) -> float | None:
    """A job's objective as a float, None unless it is a finite number."""
    try:
        v = jsonio.number(objective)  # a float, or JSONError (a ValueError)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def best_job(jobs: dict[int, dict], direction: str) -> dict | None:
    """The winner the end table marks and the parent's best.* tags name; ties: the first job."""
    scored = sorted((j for j in jobs.values() if finite(j.get("objective")) is not None), key=lambda j: j["num"])
    return (min if direction == "minimize" else max)(scored, key=lambda j: j["objective"]) if scored else None


def swept_values(job: dict, keys) -> dict[str, str]:
    """{swept key: the value this job ran with}, read from its overrides (`+key=v` and `key=v` alike)."""
    out = {}
    for o in job.get("overrides") or []:
        key, sep, value = str(o).partition("=")
        if sep and key.lstrip("+~") in keys:
            out[key.lstrip("+~")] = value
    return out


def _cell(text: str) -> str:
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def sweep_table(sweep: dict, jobs: dict[int, dict], best: dict | None, parent: list[str]) -> list[str]:
    """The lines a sweep ends with: every job in job order if at most MAX_ROWS, else the best MAX_ROWS; `best` is
    the winning job's record (best_job, as the parent's best.* tags), `parent` where that run is."""
    keys = list(sweep.get("swept") or {})
    objective = str(sweep.get("objective") or "objective")
    direction = sweep.get("direction", "minimize")
    counts = Counter(str(j.get("status", "unknown")) for j in jobs.values())
    tally = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (kv[0] != "complete", kv[0])))
    lines = [f"sweep {sweep.get('name') or 'sweep'}-{sweep.get('id', '?')}: {len(jobs)} jobs"
             + (f" ({tally})" if tally else "") + f", {objective} ({'min' if direction == 'minimize' else 'max'})"]
    if not jobs:
        return [*lines, f"parent: {parent[0]}", *parent[1:]]
    shown = sorted(jobs.values(), key=lambda j: j["num"])
    if len(shown) > MAX_ROWS:  # rank: the scored ones best first, then the rest in job order
        sign = 1 if direction == "minimize" else -1
        shown.sort(key=lambda j: (finite(j.get("objective")) is None, sign * (finite(j.get("objective")) or 0.0),
                                  j["num"]))
        shown = shown[:MAX_ROWS]
    rows = [["job", *keys, objective, "status"]]
    for j in shown:
        values = swept_values(j, keys)
        v = finite(j.get("objective"))
        rows.append([str(j["num"]), *(_cell(values.get(k, "")) for k in keys),
                     "-" if v is None else f"{v:.6g}", str(j.get("status", "unknown"))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    numeric = {0, len(widths) - 2}  # the job number and the objective: right-aligned
    for r, j in zip(rows, [None, *shown]):
        mark = "*" if j is not None and best is not None and j["num"] == best["num"] else " "
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append(f"  {mark} " + "  ".join(cells).rstrip())
    if len(jobs) > len(shown):
        lines.append(f"  ... {len(jobs) - len(shown)} more jobs (the {len(shown)} best are shown; every job is "
                     f"in {sweep.get('dir', 'the sweep directory')}/jobs/)")
    if best is not None:
        where = best.get("run_uri") or best.get("run_dir") or ""
        lines.append(f"best: job {best['num']} ({best.get('name', '')}) {where}".rstrip())
    else:
        lines.append(f"best: none (no job has a finite {objective})")
    return [*lines, f"parent: {parent[0]}", *parent[1:]]


def experiment_page(tracking_uri: str, experiment_id: str) -> str:
    """Where an experiment's runs show in mlflow 3's UI: 3.17 opens GenAI traces unless the address asks for the
    machine-learning view (it does not go by the experiment's mlflow.experimentKind tag)."""
    route = f"#/experiments/{experiment_id}?workflowType=machine_learning"
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/{route}"
    return f"`mlflow ui --backend-store-uri {tracking_uri}`, then http://127.0.0.1:5000/{route}"
