"""Pictures of a run: train/val loss, learning rate and tokens/s against step, from metrics.jsonl.

Written at the end of every run as `output_dir/metrics.png`, and on demand for several runs overlaid
(`scripts/plot_metrics.py RUN [RUN ...]`). Uses matplotlib's Figure directly (no pyplot, no display,
no global backend switch), imported only when a picture is drawn: it costs about a second to import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PICTURE = "metrics.png"


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The records of `run/metrics.jsonl` (a torn last line from a killed run is skipped)."""
    records = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get("kind") == kind and isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(runs: list[Path], out: Path) -> Path:
    """Draw every run's curves into one PNG at `out` (one colour per run) and return its path."""
    from matplotlib.figure import Figure  # lazy: keeps `train.py` start-up fast
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(3, 2))
    ax_loss, ax_lr, ax_tok = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # e.g. a/run and b/run: the folder names alone would not tell them apart
        names = [str(run) for run in runs]
    for i, (run, name) in enumerate(zip(runs, names, strict=True)):
        records, color = read_metrics(run), f"C{i % 10}"
        steps, loss = _series(records, "train", "loss")
        ax_loss.plot(steps, loss, color=color, linewidth=1.2, label=f"{name} train")
        steps, val = _series(records, "eval", "val_loss")
        ax_loss.plot(steps, val, color=color, linestyle="--", marker="o", markersize=4, label=f"{name} val")
        ax_lr.plot(*_series(records, "train", "lr"), color=color, label=name)
        ax_tok.plot(*_series(records, "train", "tokens_per_sec"), color=color, label=name)
    for ax, title, ylabel in ((ax_loss, "loss", "loss"), (ax_lr, "learning rate", "lr"), (ax_tok, "throughput (all ranks)", "tokens/s")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax_loss.legend(fontsize="small", ncols=2 if len(runs) > 3 else 1)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if len(runs) > 1:
        ax_tok.legend(fontsize="small")
    fig.suptitle(", ".join(names))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
