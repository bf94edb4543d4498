"""The pipeline schedule as measured: record forward/backward spans, compute the bubble, draw the picture.

One "flush" is one pass of all micro-batches through the pipeline (forward and backward), i.e. one
`schedule.step` or one accumulation micro-step. Each span is (row, stage, micro-batch, kind, start, end)
in seconds; kind is F (forward), B (backward; under the zero-bubble schedules only the input's gradient)
or W (the weights' gradient, zero-bubble schedules). A row is a device (in-process executor) or a pipeline
rank (multi-process executor; with the interleaved and V schedules a rank runs several stages). The bubble
is the share of row-time in which a row computes nothing: 1 - busy / (rows x makespan).

Ideal bubbles with S rows, M micro-batches, V stages per row, when every stage takes the same time:
GPipe / 1F1B (S-1)/(M+S-1); interleaved 1F1B (S-1)/(V*M+S-1). The zero-bubble schedules (Qi et al. 2023,
arXiv:2401.10241) assume forward, input-backward and weight-backward each take one unit t: the interleaved
ZB1P leaves (S-1) t idle against 3VM t of work, (S-1)/(3VM+S-1); ZB-V and DualPipeV leave none once
M >= 2S. Real B and W are rarely equal, so the measured bubble is the number to read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_train.checkpoint.writer import write_with

Span = tuple[int, int, int, str, float, float]  # row, stage, micro-batch, "F" or "B", start s, end s


ZERO_BUBBLE_V = ("zbv", "dualpipev")


def ideal_bubble(n_rows: int, microbatches: int, stages_per_row: int = 1, schedule: str = "1f1b") -> float:
    if schedule in ZERO_BUBBLE_V:
        return 0.0
    units = 3 if schedule == "interleavedzb" else 1  # F, B, W of equal time against F+B
    return (n_rows - 1) / (units * stages_per_row * microbatches + n_rows - 1)


def ideal_formula(stages_per_row: int, schedule: str) -> str:
    if schedule in ZERO_BUBBLE_V:
        return "0 (F = B = W, M >= 2S)"
    if schedule == "interleavedzb":
        return f"(S-1)/(3*V*M+S-1), V={stages_per_row},"
    return "(S-1)/(M+S-1)" if stages_per_row == 1 else f"(S-1)/(V*M+S-1), V={stages_per_row},"


def bubble_fraction(spans: list[Span], n_rows: int) -> float | None:
    if not spans:
        return None
    start, end = min(s[4] for s in spans), max(s[5] for s in spans)
    if end <= start:
        return None
    busy = sum(s[5] - s[4] for s in spans)
    return max(0.0, 1.0 - busy / (n_rows * (end - start)))


class Clock:
    """Time stamps on a device: host time on CPU; on GPUs CUDA events, read once the stamped work is done, so timing
    a flush adds no wait between its chunks. `start` waits for the device once, to tie its events to the host's clock
    (`host`: time.time to compare processes, perf_counter within one)."""

    def __init__(self, devices: list[torch.device], host: Callable[[], float] = time.perf_counter):
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.base: dict[torch.device, object] = {}
        self.host, self.t0 = host, 0.0

    def start(self) -> None:
        for d in self.cuda:
            torch.cuda.synchronize(d)
        self.t0 = self.host()
        for d in self.cuda:
            self.base[d] = torch.cuda.Event(enable_timing=True)
            self.base[d].record(torch.cuda.current_stream(d))

    def now(self, device: torch.device):
        if device.type != "cuda":
            return self.host()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds(self, stamp, device: torch.device) -> float:
        """Seconds since start(); call after the stamped work finished (an event not reached yet is waited for)."""
        if device.type != "cuda":
            return stamp - self.t0
        stamp.synchronize()
        return self.base[device].elapsed_time(stamp) / 1e3


class Recorder:
    """Keeps the spans of the last few flushes. The very first flush (lazy init, shape exchange) is
    used only when the run has no other."""

    def __init__(self, keep: int = 50):
        self.flushes: deque[list[Span]] = deque(maxlen=keep)
        self.first: list[Span] | None = None
        self.current: list[Span] | None = None

    def start_flush(self) -> None:
        self.end_flush()
        self.current = []

    def add(self, row: int, stage: int, mb: int, kind: str, t0: float, t1: float) -> None:
        if self.current is not None:
            self.current.append((row, stage, mb, kind, t0, t1))

    def end_flush(self) -> None:
        if self.current:
            if self.first is None:
                self.first = self.current
            else:
                self.flushes.append(self.current)
        self.current = None

    def steady(self) -> list[list[Span]]:
        self.end_flush()
        return list(self.flushes) or ([self.first] if self.first else [])


def summarize(flushes: list[list[Span]], n_rows: int, microbatches: int, stages_per_row: int = 1, schedule: str = "1f1b") -> dict:
    """Mean measured bubble over the recorded flushes, beside the ideal."""
    measured = [b for b in (bubble_fraction(f, n_rows) for f in flushes) if b is not None]
    return {
        "pipeline_bubble_measured": sum(measured) / len(measured) if measured else None,
        "pipeline_bubble_ideal": ideal_bubble(n_rows, microbatches, stages_per_row, schedule),
        "pipeline_flushes_measured": len(measured),
    }


def draw(spans: list[Span], row_labels: list[str], path: Path, title: str) -> None:
    """One row per device/rank; blue = forward, orange = backward (input), green = weight gradient, white = bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s[4] for s in spans)
    span_ms = (max(s[5] for s in spans) - t0) * 1e3
    multi_stage = len({s[1] for s in spans}) > len(row_labels)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(row_labels) + 2.0))
    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    for row, stage, mb, kind, a, b in spans:
        left, width = (a - t0) * 1e3, (b - a) * 1e3
        ax.barh(row, width, left=left, height=0.8, color=colors[kind], edgecolor="black", linewidth=0.4)
        label = f"{kind}{mb}" if not multi_stage else f"{kind}{mb}s{stage}"
        if width > span_ms * 0.012 * len(label):  # a label only where it fits
            ax.text(left + width / 2, row, label, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title, fontsize=10)
    handles = [
        Patch(color=colors["F"], label="forward of micro-batch i (Fi)"),
        Patch(color=colors["B"], label="backward (Bi)"),
        *([Patch(color=colors["W"], label="weight gradient, zero bubble (Wi)")] if any(s[3] == "W" for s in spans) else []),
        Patch(facecolor="white", edgecolor="black", label="white: bubble (idle)"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    flushes: list[list[Span]],
    row_labels: list[str],
    microbatches: int,
    stages_per_row: int,
    out: Path,
    title: str,
    say,
    schedule: str = "1f1b",
) -> dict:
    """Draw the last measured flush to out/pipeline_timeline.png; return the bubble figures for summary.json."""
    result = summarize(flushes, len(row_labels), microbatches, stages_per_row, schedule)
    if flushes:
        path = out / "pipeline_timeline.png"
        measured = result["pipeline_bubble_measured"]
        write_with(  # checked and listed in output_dir (checkpoint/writer.py)
            path,
            lambda path: draw(
                flushes[-1],
                row_labels,
                path,
                f"{title}\nbubble measured {measured:.0%} (mean of {len(flushes)} flushes), ideal {result['pipeline_bubble_ideal']:.0%}",
            ),
        )
        result["pipeline_timeline"] = path.name
        say(
            f"[parallel_train] pipeline bubble: measured {measured:.1%}, ideal {ideal_formula(stages_per_row, schedule)} = "
            f"{result['pipeline_bubble_ideal']:.1%} (S={len(row_labels)}, M={microbatches}); schedule picture: {path}"
        )
    return result
