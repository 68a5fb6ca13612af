"""The table a sweep ends with (docs/tracking.md: Sweeps): a pure function of sweep.json and jobs/*.json."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from pathlib import Path

from pipeline.files import jsonio
from pipeline.files.limits import MAX_JOB_RECORD
from pipeline.run.report import run_page

log = logging.getLogger("pipeline")

MAX_ROWS = 12  # with the header, the best and the parent lines: under 20 lines, whatever the sweep
MAX_CELL = 24  # a swept value wider than this is cut (the job's run name has it whole)


def finite(objective) -> float | None:
    """A job's objective as a float, None unless it is a finite number."""
    try:
        v = jsonio.number(objective)  # a float, or JSONError (a ValueError)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


class SweepRecordError(ValueError):
    """A sweep.json that does not say what every reader needs of it."""


def direction(sweep: dict) -> str:
    """ "minimize" or "maximize", as sweep.json recorded it at the start (from best-val's mode): never a guess."""
    value = sweep.get("direction")
    if value not in ("minimize", "maximize"):
        where = Path(str(sweep.get("dir", "."))) / "sweep.json"
        why = "not minimize or maximize (the sweep's start records it; re-run the sweep)"
        raise SweepRecordError(f"{where}: direction={value!r}: {why}")
    return value


def best_job(jobs: dict[int, dict], sweep: dict) -> dict | None:
    """The winner the end table marks and the parent's best.* tags name; ties: the first job."""
    scored = [j for j in jobs.values() if finite(j.get("objective")) is not None]
    pick = min if direction(sweep) == "minimize" else max
    return pick(sorted(scored, key=lambda j: j["num"]), key=lambda j: j["objective"], default=None)


SHOWN_DIGITS = 4  # significant digits of a swept float in a run's name (mlflow cuts 18 to `0.0…`)
TABLE_DIGITS = 6  # ... and in the end table, as a job's own lines print its numbers (`:.6g`)
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][+-]?\d+)")


def shown_value(value: str, digits: int = SHOWN_DIGITS) -> str:
    """A float literal cut to `digits` significant digits (`0.0031622776601683794` -> `0.003162`), else as given."""
    short = f"{float(value):.{digits}g}" if _FLOAT.fullmatch(value) else value
    return value if short == value or float(short) == float(value) else short


def parent_name(swept) -> str:
    """`lr×n_layer sweep`: each swept key's last part (whole where two share it)."""
    short = [k.rsplit(".", 1)[-1] for k in swept]
    named = "×".join(s if short.count(s) == 1 else k for s, k in zip(short, swept))
    return f"{named} sweep".strip()


def swept_values(overrides: list[str], keys) -> dict[str, str]:
    """{swept key: the value a job ran with}, read from its overrides (`+key=v` and `key=v` alike)."""
    parts = (str(o).partition("=") for o in overrides)
    return {k.lstrip("+~"): v for k, sep, v in parts if sep and k.lstrip("+~") in keys}


def sweep_table(sweep: dict, jobs: dict[int, dict], best: dict | None, parent: list) -> list[str]:
    """Every job in job order (the best MAX_ROWS of more), `best` (best_job) marked, `parent`: where it is."""
    keys = list(sweep.get("swept") or {})
    objective = str(sweep.get("objective") or "objective")
    minimize = direction(sweep) == "minimize"
    counts = Counter(str(j.get("status", "unknown")) for j in jobs.values())
    ordered = sorted(counts.items(), key=lambda kv: (kv[0] != "complete", kv[0]))
    tally = ", ".join(f"{n} {s}" for s, n in ordered)
    head = f"sweep {sweep.get('name') or 'sweep'}-{sweep.get('id', '?')}: {len(jobs)} jobs"
    head += f" ({tally})" if tally else ""
    lines = [f"{head}, {objective} ({'min' if minimize else 'max'})"]
    if not jobs:
        return [*lines, f"parent: {parent[0]}", *parent[1:]]
    shown = sorted(jobs.values(), key=lambda j: j["num"])
    if len(shown) > MAX_ROWS:  # rank: the scored ones best first, then the rest in job order
        sign = 1 if minimize else -1
        score = {j["num"]: finite(j.get("objective")) for j in shown}
        shown.sort(key=lambda j: (score[j["num"]] is None, sign * (score[j["num"]] or 0), j["num"]))
        shown = shown[:MAX_ROWS]
    rows = [["job", *keys, objective, "status"]]
    for j in shown:
        values = swept_values(j.get("overrides") or [], keys)
        cells = [shown_value(values.get(k, ""), TABLE_DIGITS) for k in keys]
        cells = [c if len(c) <= MAX_CELL else c[: MAX_CELL - 3] + "..." for c in cells]
        shown_v = "-" if (v := finite(j.get("objective"))) is None else f"{v:.6g}"
        rows.append([str(j["num"]), *cells, shown_v, str(j.get("status", "unknown"))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    # the job number and the objective: right-aligned
    just = [str.rjust if i in (0, len(widths) - 2) else str.ljust for i in range(len(widths))]
    for r, row_job in zip(rows, [None, *shown]):  # the header row has no job
        won = row_job is not None and best is not None and row_job["num"] == best["num"]
        cells = [j(c, w) for j, c, w in zip(just, r, widths)]
        lines.append(f"  {'*' if won else ' '} " + "  ".join(cells).rstrip())
    if (hidden := len(jobs) - len(shown)) > 0:
        where = f"every job is in {sweep.get('dir', 'the sweep directory')}/jobs/"
        lines.append(f"  ... {hidden} more jobs (the {len(shown)} best are shown; {where})")
    if best is not None:
        where = run_page(best["run_uri"]) if best.get("run_uri") else best.get("run_dir") or ""
        lines.append(f"best: job {best['num']} ({best.get('name', '')}) {where}".rstrip())
    else:
        lines.append(f"best: none (no job has a finite {objective})")
    return [*lines, f"parent: {parent[0]}", *parent[1:]]


def read_jobs(directory: Path) -> dict[int, dict]:
    """{num: record} of jobs/*.json; a damaged record is a report, not state: named in a warning, left out."""
    out = {}
    for p in sorted((Path(directory) / "jobs").glob("*.json")):
        try:
            record = jsonio.read(p, MAX_JOB_RECORD)
            out[int(record["num"])] = record
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = str(e).removeprefix(f"{p}: ") or type(e).__name__
            log.warning("sweep job record %s left out: %s", p, why)
    return out
