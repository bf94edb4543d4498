#!/usr/bin/env python3
"""Pipeline speed on CPU: 2 stage processes (one thread each) against one process (one thread), M micro-batches.

    python scripts/bench/pipeline.py                      M in 1 2 4 8, 2 repeats, about 4 minutes
    python scripts/bench/pipeline.py --microbatches 1 4 --repeats 3 --steps 60
    python scripts/bench/pipeline.py --update-docs        also write the table into docs/BENCHMARKS.md
    python scripts/bench/pipeline.py --schedules gpipe 1f1b interleaved1f1b interleavedzb zbv dualpipev --microbatches 4
                                                          the schedules side by side at one M (second table)

Each figure is a real launch of train.py (`python train.py` for the single process, `torchrun
--nproc-per-node 2 train.py parallel.pipeline_stages=2 ...` for the pipeline), steady-state tokens/s from
its summary.json (the first log interval left out). Repeats run round-robin so a change in machine load
hits every cell alike; the median is reported with the 1-minute load average seen during the cell.
The ideal speed-up of S stages with M micro-batches is M*S/(M+S-1) (balanced stages, free communication).
A row for the one-process executor on [cpu,cpu] shows that without a second device nothing overlaps.
With --schedules, every schedule runs at the first --microbatches value instead (4 stages of the model on the
2 ranks for interleaved1f1b, interleavedzb, zbv and dualpipev), with its measured bubble beside its ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DOC, REPO, free_port, update_docs

PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SECTION = "## Pipeline parallelism"
START, END = "<!-- pipeline:start -->", "<!-- pipeline:end -->"
SCHEDULE_MARKERS = ("<!-- pipeline-schedules:start -->", "<!-- pipeline-schedules:end -->")
# The baby GPT of the reference numbers (4 layers, 128 wide, block 64); batch 32 so M=8 still has 4 samples.
MODEL = (
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=128",
    "model.block_size=64",
    "train.batch_size=32",
    "tracker=none",
    "eval.interval=0",
    "eval.iters=2",
    "checkpoint.interval=0",
    "train.warmup_steps=0",
)


def launch(kind: str, m: int, steps: int, schedule: str, tmp: Path) -> dict:
    """kind: single, inprocess, pipeline (schedule at M=m), or schedule:<name> (that schedule at M=m)."""
    if kind.startswith("schedule:"):
        kind, schedule = "schedule", kind.split(":", 1)[1]
    out = tmp / f"{kind}_m{m}_{time.monotonic_ns()}"
    common = (*MODEL, f"train.max_steps={steps}", f"train.log_interval={max(1, steps // 6)}", f"output_dir={out}")
    if kind == "single":
        cmd = [PYTHON, "train.py", *common]
    elif kind == "inprocess":
        cmd = [PYTHON, "train.py", *common, "parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]", f"parallel.microbatches={m}"]
    else:
        cmd = [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "train.py",
            *common,
            "parallel.pipeline_stages=2",
            f"parallel.microbatches={m}",
            f"parallel.schedule={schedule if m >= 2 or kind == 'schedule' else 'gpipe'}",
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "tok_s": summary["tokens_per_sec"],
        "bubble": summary.get("pipeline_bubble_measured"),
        "ideal": summary.get("pipeline_bubble_ideal"),
        "load": (load_before + os.getloadavg()[0]) / 2,
    }


def median_of(cells: dict, key, what: str = "tok_s") -> float | None:
    """The median of one measured figure over a cell's repeats (None when none measured it)."""
    values = [r[what] for r in cells[key] if r[what] is not None]
    return statistics.median(values) if values else None


def table(cells: dict[tuple[str, int], list[dict]], microbatches: list[int], schedule: str, steps: int, repeats: int) -> str:
    single = median_of(cells, ("single", 0))
    lines = [
        f"2 CPU processes x 1 thread (schedule {schedule}; gpipe for M=1, where they are the same) against 1 process x 1 thread; baby GPT (4 layers, 128 wide, "
        f"block 64), batch 32, {steps} steps, median of {repeats}. Command: `python scripts/bench/pipeline.py`.",
        "",
        "| micro-batches M | single process tok/s | 2-stage pipeline tok/s | speed-up | ideal M*S/(M+S-1) | bubble measured | bubble ideal (S-1)/(M+S-1) | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in microbatches:
        pipe, bubble = median_of(cells, ("pipeline", m)), median_of(cells, ("pipeline", m), "bubble")
        load = statistics.mean(r["load"] for k in (("single", 0), ("pipeline", m)) for r in cells[k])
        lines.append(
            f"| {m} | {single:,.0f} | {pipe:,.0f} | {pipe / single:.2f}x | {2 * m / (m + 1):.2f}x | "
            f"{bubble:.0%} | {1 / (m + 1):.0%} | {load:.1f} |"
        )
    if ("inprocess", 4) in cells:
        inproc = median_of(cells, ("inprocess", 4))
        lines.append(
            f"| 4, one process on [cpu,cpu] (executor 1) | {single:,.0f} | {inproc:,.0f} | {inproc / single:.2f}x | 1.00x "
            f"(one thread: no overlap) | {median_of(cells, ('inprocess', 4), 'bubble'):.0%} | 20% | - |"
        )
    return "\n".join(lines)


def schedule_table(cells: dict, schedules: list[str], m: int, steps: int, repeats: int) -> str:
    single = median_of(cells, ("single", 0))
    lines = [
        f"2 CPU processes x 1 thread, M={m} micro-batches, each schedule against 1 process x 1 thread; baby GPT (4 layers, "
        f"128 wide, block 64), batch 32, {steps} steps, median of {repeats}. interleaved1f1b, interleavedzb, zbv and dualpipev "
        "hold 2 stages per rank (4 stages of the model). Command: "
        f"`python scripts/bench/pipeline.py --schedules {' '.join(schedules)} --microbatches {m}`.",
        "",
        "| schedule | tok/s | speed-up vs 1 process | bubble measured | bubble ideal | load avg (1 min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in schedules:
        key = (f"schedule:{name}", m)
        tok, bubble, ideal = median_of(cells, key), median_of(cells, key, "bubble"), median_of(cells, key, "ideal")
        load = statistics.mean(r["load"] for r in cells[key])
        lines.append(f"| {name} | {tok:,.0f} | {tok / single:.2f}x | {bubble:.0%} | {ideal:.0%} | {load:.1f} |")
    lines.append(f"| (1 process, no pipeline) | {single:,.0f} | 1.00x | - | - | - |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    ap.add_argument("--no-inprocess", action="store_true", help="skip the one-process [cpu,cpu] row")
    ap.add_argument("--schedules", nargs="+", help="compare these schedules at the first --microbatches value instead")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()

    if args.schedules:
        plan = [("single", 0)] + [(f"schedule:{name}", args.microbatches[0]) for name in args.schedules]
    else:
        plan = [("single", 0)] + [("pipeline", m) for m in args.microbatches] + ([] if args.no_inprocess else [("inprocess", 4)])
    cells: dict[tuple[str, int], list[dict]] = {key: [] for key in plan}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for r in range(args.repeats):
            for kind, m in plan:
                cells[(kind, m)].append(launch(kind, m, args.steps, args.schedule, Path(tmp)))
                last = cells[(kind, m)][-1]
                print(f"repeat {r + 1}: {kind:9s} M={m}: {last['tok_s']:,.0f} tok/s, load {last['load']:.1f}", flush=True)
    if args.schedules:
        text = schedule_table(cells, args.schedules, args.microbatches[0], args.steps, args.repeats)
    else:
        text = table(cells, args.microbatches, args.schedule, args.steps, args.repeats)
    print(text)
    if args.update_docs:
        update_docs(text, *(SCHEDULE_MARKERS if args.schedules else (START, END)), SECTION)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
