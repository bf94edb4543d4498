#!/usr/bin/env python3
"""Benchmark matrix: configs x topologies x speed features, each cell repeated, medians and spread.

    python scripts/bench/benchmark.py --quick                  about 3-4 minutes on this 2-core machine
    python scripts/bench/benchmark.py                          the full matrix (compile, bare DDP included), about 10 minutes
    python scripts/bench/benchmark.py --cells bare,template --repeats 5 --steps 400
    python scripts/bench/benchmark.py --update-docs            also put the table into docs/BENCHMARKS.md

Every cell is a real launch (`python train.py`, `torchrun ... train.py` or `scripts/bench/bare_loop.py`) in a
fresh process. Repeats run round-robin over the cells (repeat 1 of every cell, then repeat 2, ...) so a
change in machine load hits every cell alike; the bare loop and train.py run back to back. Figures are
steady state (the first log interval, evaluation and checkpoints left out; see trainer.py). The 1-minute
load average is recorded next to every cell: on a shared machine it says how far to trust a figure.

Writes OUT/benchmark.json (every run) and OUT/benchmark.md (the table); OUT defaults to runs/benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import DOC, REPO, free_port, update_docs

from parallel_train.core.json_text import json_text  # JSON without NaN (null instead)

PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
BASELINE = "configs/shakespeare_char_cpu.yaml"
DOC_START, DOC_END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"


@dataclass
class Cell:
    name: str  # short id, used by --cells
    feature: str  # what the row changes against the template row
    topology: str  # processes x threads, in words
    config: str = BASELINE
    overrides: tuple[str, ...] = ()
    runner: str = "train"  # train | torchrun | bare | bare_torchrun
    nproc: int = 1
    threads: int | None = None  # OMP_NUM_THREADS; None: torch's default (one per core)
    in_quick: bool = True
    runs: list[dict] = field(default_factory=list)


def cells() -> list[Cell]:
    both = f"1 process, {os.cpu_count()} threads"
    return [
        Cell("bare", "bare loop (scripts/bench/bare_loop.py: no framework)", both, runner="bare"),
        Cell(
            "bare_malloc",
            "bare loop + the template's malloc setting (--keep-freed-memory)",
            both,
            runner="bare",
            overrides=("--keep-freed-memory",),
            in_quick=False,
        ),
        Cell("template", "train.py, defaults (fp32, eager)", both),
        Cell("bf16", "bf16 autocast (train.mixed_precision=bf16)", both, overrides=("train.mixed_precision=bf16",)),
        Cell("compile", "torch.compile (train.compile=true)", both, overrides=("train.compile=true",), in_quick=False),
        Cell(
            "ckpt",
            "activation checkpointing (model.activation_checkpointing=full)",
            both,
            overrides=("model.activation_checkpointing=full",),
        ),
        Cell("workers1", "1 DataLoader worker (data.num_workers=1)", both, overrides=("data.num_workers=1",)),
        Cell("workers2", "2 DataLoader workers (data.num_workers=2)", both, overrides=("data.num_workers=2",), in_quick=False),
        Cell(
            "bare1x1",
            "bare loop, one thread",
            "1 process, 1 thread",
            runner="bare",
            threads=1,
            overrides=("--keep-freed-memory",),
            in_quick=False,
        ),
        Cell("1x1", "train.py, one thread", "1 process, 1 thread", threads=1),
        Cell("2x1", "train.py, DDP (torchrun, gloo)", "2 processes, 1 thread each", runner="torchrun", nproc=2, threads=1),
        Cell(
            "bare2x1",
            "bare DDP loop (torch DDP, gloo; no framework)",
            "2 processes, 1 thread each",
            runner="bare_torchrun",
            nproc=2,
            threads=1,
            overrides=("--keep-freed-memory",),
            in_quick=False,
        ),
    ]


# ---------------------------------------------------------------- running one cell


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def busy_cpu_s() -> float:
    """CPU seconds all processes on the machine have used (the non-idle columns of /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out
    except BaseException:  # Ctrl-C or SIGTERM (see main): take the launch down with us
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def run_cell(cell: Cell, steps: int, tmp: Path, timeout: float) -> dict:
    """One launch of the cell; returns its figures (or an error)."""
    out_dir = tmp / f"{cell.name}-{len(cell.runs)}"
    common = (
        f"train.max_steps={steps}",
        f"train.lr_decay_steps={steps}",
        "train.log_interval=10",
        "eval.interval=0",
        "eval.iters=2",
        "checkpoint.interval=0",
        "tracker=none",
        "resume=none",
        f"output_dir={out_dir}",
        *cell.overrides,
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp), WANDB_MODE="disabled", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)
    if cell.threads:
        env["OMP_NUM_THREADS"] = str(cell.threads)
    script = "scripts/bench/bare_loop.py" if cell.runner.startswith("bare") else "train.py"
    cmd = [PYTHON, script, "--config", cell.config, *common]
    if cell.runner.endswith("torchrun"):
        cmd = [TORCHRUN, "--nproc-per-node", str(cell.nproc), "--master-port", str(free_port()), *cmd[1:]]
    load_before, t0, busy0, mine0 = load1(), time.perf_counter(), busy_cpu_s(), children_cpu_s()
    rc, output = launch(cmd, env, timeout)
    wall = time.perf_counter() - t0
    # Cores other processes kept busy meanwhile: all busy CPU time minus this launch's own (a cleaner
    # "how quiet was the machine" than the load average, which counts our own processes too).
    others = max(0.0, (busy_cpu_s() - busy0) - (children_cpu_s() - mine0)) / wall
    result = {"cmd": " ".join(cmd), "rc": rc, "wall_s": wall, "load1": (load_before + load1()) / 2, "other_cores": others}
    if rc != 0:
        result["error"] = output[-2000:]
        return result
    if cell.runner.startswith("bare"):
        figures = json.loads(output.strip().splitlines()[-1])
        result.update(tokens_per_sec=figures["tokens_per_sec"], losses={int(k): v for k, v in figures["losses"].items()})
        return result
    summary = json.loads((out_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    steady = records[1:] or records  # the first interval holds warm-up (and compilation)
    result.update(
        tokens_per_sec=summary["tokens_per_sec"],
        time_to_first_step_s=summary["time_to_first_step_s"],
        peak_memory_mb=summary["peak_memory_mb"],
        final_train_loss=summary["final_train_loss"],
        data_time_frac=statistics.mean(r["data_time_frac"] for r in steady),
        losses={r["step"]: r["loss"] for r in records},
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


# ---------------------------------------------------------------- statistics and the table


def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * (max(values) - min(values)) / med if med else 0.0,
        "n": len(values),
    }


def cell_stats(cell: Cell) -> dict:
    ok = [r for r in cell.runs if r["rc"] == 0]
    pick = lambda key: [r[key] for r in ok if r.get(key) is not None]  # noqa: E731
    return {
        key: stats(pick(key))
        for key in ("tokens_per_sec", "data_time_frac", "time_to_first_step_s", "peak_memory_mb", "load1", "other_cores")
    } | {"failed": len(cell.runs) - len(ok)}


def ratio_of_medians(a: Cell | None, b: Cell | None) -> float | None:
    sa, sb = (cell_stats(c)["tokens_per_sec"] if c else None for c in (a, b))
    return sa["median"] / sb["median"] if sa and sb else None


def paired_ratios(a: Cell, b: Cell) -> list[float]:
    """Ratio per repeat (run i of a against run i of b, launched back to back)."""
    return [x["tokens_per_sec"] / y["tokens_per_sec"] for x, y in zip(a.runs, b.runs, strict=False) if x["rc"] == 0 and y["rc"] == 0]


def loss_gap(a: Cell, b: Cell) -> float | None:
    """Largest |loss difference| at common log steps between the first runs of a and b (same batches?)."""
    la, lb = (next((r["losses"] for r in c.runs if r["rc"] == 0), None) for c in (a, b))
    if not la or not lb:
        return None
    common = set(la) & set(lb)
    return max(abs(la[s] - lb[s]) for s in common) if common else None


def fmt(s: dict | None, scale: float = 1.0, digits: int = 0, pct: bool = False) -> str:
    if not s:
        return "-"
    if pct:
        return f"{100 * s['median']:.2f}%"
    return f"{s['median'] * scale:,.{digits}f}"


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def report(selected: list[Cell], args: argparse.Namespace, info: dict) -> tuple[str, dict]:
    by = {c.name: c for c in selected}
    template = by.get("template")
    lines = [
        f"Machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, torch {info['torch']}; {info['date']}.",
        f"Each cell: {args.repeats} launches x {args.steps} steps of `{BASELINE}` (batch 12 x 64 tokens per process), "
        "median tokens/s over the steady state (first 10 steps, evaluation and checkpoints left out); vs template = median "
        "of the per-repeat ratios; "
        "spread = (max - min) / median over the launches; others = CPU cores other processes kept busy during the "
        "launches (median; the machine has "
        + str(info["cores"])
        + "); load = 1-minute load average (counts the benchmark's own processes).",
        "",
        "| cell | topology | feature | tokens/s (median) | spread | vs template | data wait | first step (s) | peak RSS (MB) | others | load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in selected:
        s = cell_stats(c)
        # Median of per-repeat ratios: run i of a cell and of the template ran minutes apart at most.
        pairs = paired_ratios(c, template) if template and c is not template and c.nproc == 1 and not c.threads else []
        vs = statistics.median(pairs) if pairs else None
        spread = f"{s['tokens_per_sec']['spread_pct']:.1f}%" if s["tokens_per_sec"] else "-"
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(
            f"| {c.name} | {c.topology} | {c.feature}{failed} | {fmt(s['tokens_per_sec'])} | {spread} | "
            f"{f'{vs:.3f}x' if vs else '-'} | {fmt(s['data_time_frac'], pct=True)} | "
            f"{fmt(s['time_to_first_step_s'], digits=1)} | {fmt(s['peak_memory_mb'])} | {fmt(s['other_cores'], digits=2)} | "
            f"{fmt(s['load1'], digits=2)} |"
        )

    targets: dict = {}
    lines += ["", "| target | measured | goal | met |", "|---|---:|---:|:---:|"]
    if template and "bare" in by:
        pairs = paired_ratios(template, by["bare"])
        r = statistics.median(pairs) if pairs else None
        gap = loss_gap(template, by["bare"])
        targets["template_vs_bare"] = {"median_of_paired_ratios": r, "paired_ratios": pairs, "max_loss_gap": gap}
        lines.append(
            f"| train.py tokens/s / bare loop tokens/s (median of {len(pairs)} back-to-back pairs) | "
            f"{f'{r:.3f}' if r else '-'} | >= 0.97 | {'yes' if r and r >= 0.97 else 'no'} |"
        )
        if gap is not None:
            lines.append(
                f"| same batches: largest loss gap, train.py vs bare loop, at equal steps | {gap:.1e} | < 1e-3 | "
                f"{'yes' if gap < 1e-3 else 'no'} |"
            )
    if "2x1" in by and "1x1" in by:
        r = ratio_of_medians(by["2x1"], by["1x1"])
        targets["dp_scaling_2_procs"] = r
        lines.append(
            f"| DDP scaling: 2 processes x 1 thread / 1 process x 1 thread (tokens/s) | {f'{r:.2f}x' if r else '-'} | "
            f">= 1.80x | {'yes' if r and r >= 1.8 else 'no'} |"
        )
    if "bare2x1" in by and "bare1x1" in by:
        r = ratio_of_medians(by["bare2x1"], by["bare1x1"])
        targets["bare_dp_scaling_2_procs"] = r
        lines.append(
            f"| the floor: bare DDP loop, 2 processes x 1 thread / bare loop x 1 thread | {f'{r:.2f}x' if r else '-'} | (reference) | - |"
        )
    if "2x1" in by and "bare2x1" in by:
        pairs = paired_ratios(by["2x1"], by["bare2x1"])
        r = statistics.median(pairs) if pairs else None
        targets["ddp_template_vs_bare_ddp"] = r
        lines.append(
            f"| DDP: train.py / bare DDP loop, 2 processes x 1 thread (median of {len(pairs)} pairs) | "
            f"{f'{r:.3f}' if r else '-'} | >= 0.97 | {'yes' if r and r >= 0.97 else 'no'} |"
        )
    if template:
        d = cell_stats(template)["data_time_frac"]
        targets["data_time_frac"] = d["median"] if d else None
        lines.append(
            f"| data wait share of the step (template) | {fmt(d, pct=True)} | < 2% | {'yes' if d and d['median'] < 0.02 else 'no'} |"
        )
        f = cell_stats(template)["time_to_first_step_s"]
        lines.append(f"| time from process start to the end of step 1 (template) | {fmt(f, digits=1)} s | reported | yes |")
    return "\n".join(lines) + "\n", targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats, no compile/2-worker cells (about 4 min)")
    ap.add_argument("--cells", default="", help=f"comma-separated cells to run (default: all); known: {', '.join(c.name for c in cells())}")
    ap.add_argument("--config", default=BASELINE, help="config of every cell (default: the baseline)")
    ap.add_argument("--steps", type=int, default=0, help="steps per launch (default 300; --quick 100)")
    ap.add_argument("--repeats", type=int, default=0, help="launches per cell (default 3; --quick 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one launch may take before it is killed")
    ap.add_argument("--out", default="runs/benchmark", help="folder for benchmark.json and benchmark.md")
    ap.add_argument("--update-docs", action="store_true", help=f"write the table into {DOC.relative_to(REPO)} between its markers")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through launch(), which kills the child
    args.steps = args.steps or (100 if args.quick else 300)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.steps < 20:
        ap.error("--steps must be at least 20 (the first 10 steps are warm-up and left out)")

    wanted = [w for w in args.cells.split(",") if w]
    known = {c.name for c in cells()}
    if unknown := [w for w in wanted if w not in known]:
        ap.error(f"unknown cells {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    selected = [c for c in cells() if (c.name in wanted if wanted else (c.in_quick or not args.quick))]
    for c in selected:
        c.config = args.config

    out = (REPO / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        for rep in range(args.repeats):
            for c in selected:
                r = run_cell(c, args.steps, Path(tmp), args.timeout)
                c.runs.append(r)
                got = f"{r['tokens_per_sec']:,.0f} tok/s" if r["rc"] == 0 else f"FAILED (exit {r['rc']})\n{r.get('error', '')}"
                print(
                    f"[{time.perf_counter() - t0:6.0f} s] repeat {rep + 1}/{args.repeats} {c.name:<9} {got}  load {r['load1']:.2f}",
                    flush=True,
                )
    table, targets = report(selected, args, info)
    result = {
        "machine": info,
        "steps": args.steps,
        "repeats": args.repeats,
        "config": args.config,
        "total_s": time.perf_counter() - t0,
        "targets": targets,
        "cells": [
            {
                "name": c.name,
                "feature": c.feature,
                "topology": c.topology,
                "overrides": c.overrides,
                "runner": c.runner,
                "stats": cell_stats(c),
                "runs": c.runs,
            }
            for c in selected
        ],
    }
    (out / "benchmark.json").write_text(json_text(result, indent=1))
    (out / "benchmark.md").write_text(table)
    print(
        "\n" + table + f"\n{len(selected)} cells x {args.repeats} repeats in {result['total_s']:.0f} s; "
        f"wrote {out / 'benchmark.md'} and {out / 'benchmark.json'}"
    )
    if args.update_docs:
        update_docs(table, DOC_START, DOC_END)
        print(f"updated {DOC}")
    if any(r["rc"] != 0 for c in selected for r in c.runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
