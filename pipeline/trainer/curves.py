"""curves.png: loss and lr against step from a run's metrics.jsonl, drawn here for the job and the index."""

from __future__ import annotations

import io
import math
from pathlib import Path

from pipeline.files.atomic import replace_file

NAME = "curves.png"
LOSSES = ("train/loss", "val/loss")


def series(lines: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the lines holding a finite number for it, in order (a non-finite one: a gap)."""
    ok = [ln for ln in lines if type(ln.get(key)) in (int, float) and math.isfinite(ln[key])]
    return [ln["step"] for ln in ok], [ln[key] for ln in ok]


def draw(lines: list[dict]) -> bytes | None:
    """The PNG's bytes (Agg), or None; imports matplotlib (~0.5 s): at a job's end, never on the step path."""
    if not lines:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    positive = False
    for key, style in zip(LOSSES, ("-", "o-")):
        xs, ys = series(lines, key)
        if xs:
            ax_loss.plot(xs, ys, style, label=key, markersize=3)
            positive = positive or any(v > 0 for v in ys)
    ax_loss.set(ylabel="loss", yscale="log" if positive else "linear")
    ax_loss.legend()
    ax_lr.plot(*series(lines, "lr"), "-", color="tab:green")
    ax_lr.set(ylabel="lr", xlabel="step")
    for ax in (ax_loss, ax_lr):
        ax.grid(True, alpha=0.3)
    # fixed margins wide enough for the lr's ticks (0.00030): tight_layout measures every label, half the cost
    fig.subplots_adjust(left=0.13, right=0.97, top=0.97, bottom=0.08, hspace=0.08)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out.getvalue()


def write(run_dir: Path, lines: list[dict]) -> Path | None:
    """<run_dir>/curves.png from the run's whole history `lines`, replaced atomically; its path, or None."""
    if (png := draw(lines)) is None:
        return None
    replace_file(path := Path(run_dir) / NAME, png)
    return path
