#!/usr/bin/env python3
"""The device mesh on CPU: tokens/s and peak RSS of 2 ranks as DDP, FSDP2 and tensor parallel, each next to the
bare torch loop that does the same without the template (scripts/bench/bare_loop.py --mode ddp|fsdp|tp: torch DDP,
`fully_shard`, `parallelize_module`).

    python scripts/bench/mesh.py                        3 repeats x 3 modes x 2 runners, 10-25 minutes
    python scripts/bench/mesh.py --repeats 5 --steps 60 --modes fsdp tp
    python scripts/bench/mesh.py --update-docs          also write the table into docs/BENCHMARKS.md

Model: 8 layers x 512 wide (8 heads, 25M parameters), context 64, batch 4 per data-parallel rank, fp32, one
thread per process, Tiny Shakespeare. Each figure is a real launch with torchrun; steady-state tokens/s (the
first log interval left out: summary.json for train.py, the loop's own count for the bare one). Every repeat
runs each mode's bare loop and train.py back to back (a pair): the ratio template / bare is the median of the
per-pair ratios, so a change in machine load between repeats hits both sides of a pair alike. The 1-minute
load average is recorded per pair (it counts the benchmark's own two processes). Peak RSS is rank 0's. The bare
loop runs with the template's one host-side setting (--keep-freed-memory, glibc keeps freed blocks: observe/perf.py),
as bench/benchmark.py's bare_malloc cell does: without it the two differ by the allocator, not by the framework
(freed blocks kept resident raise the template's RSS; fewer page faults can make it faster).
Tensor parallel: both ranks work on the same batch, so its tokens/s count one batch per step (data parallel:
one per rank).
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

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SECTION = "## Device mesh on CPU: DDP, FSDP2, tensor parallel"
START, END = "<!-- mesh:start -->", "<!-- mesh:end -->"
MODEL = (
    "model.n_layer=8",
    "model.n_head=8",
    "model.n_embd=512",
    "model.block_size=64",
    "train.batch_size=4",
    "train.warmup_steps=0",
    "train.mixed_precision=no",
)
TEMPLATE_ONLY = ("tracker=none", "eval.interval=0", "eval.iters=1", "checkpoint.interval=0", "resume=none")
KEYS = {"ddp": (), "fsdp": ("parallel.dp_shard=2",), "tp": ("parallel.tp=2",)}
NAMES = {"ddp": "DDP", "fsdp": "FSDP2 (dp_shard 2)", "tp": "tensor parallel (tp 2)"}


def launch(runner: str, mode: str, steps: int, tmp: Path) -> dict:
    common = (*MODEL, f"train.max_steps={steps}", f"train.lr_decay_steps={steps}", f"train.log_interval={max(1, steps // 6)}")
    torchrun = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    out = tmp / f"{runner}_{mode}_{time.monotonic_ns()}"
    if runner == "bare":
        cmd = [*torchrun, "scripts/bench/bare_loop.py", "--keep-freed-memory", "--mode", mode, *common]
    else:
        cmd = [*torchrun, "train.py", *common, *TEMPLATE_ONLY, *KEYS[mode], f"output_dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    if runner == "bare":
        line = next(x for x in result.stdout.splitlines() if x.startswith("{"))
        data = json.loads(line)
        return {"tok_s": data["tokens_per_sec"], "rss": data["peak_rss_mb"][0]}
    s = json.loads((out / "summary.json").read_text())
    return {"tok_s": s["tokens_per_sec"], "rss": s["peak_memory_mb"], "local": s["local_param_numel"]}


def table(cells: dict, modes: list[str], steps: int, repeats: int, loads: dict, command: str) -> str:
    lines = [
        f"2 CPU processes x 1 thread, gloo; GPT 8 layers x 512 wide (25.3M parameters), context 64, batch 4 per "
        f"data-parallel rank, fp32; {steps} steps per launch, {repeats} back-to-back pairs per mode; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: `{command}`.",
        "",
        "| mode | parameters on rank 0 | template tok/s (median) | bare torch tok/s (median) | template / bare (median of pairs) | "
        "per-pair ratios | template peak RSS rank 0 (MB) | bare peak RSS rank 0 (MB) | load avg (1 min) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for mode in modes:
        t, b = cells[("template", mode)], cells[("bare", mode)]
        ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(t, b, strict=True)]
        med = statistics.median
        lines.append(
            f"| {NAMES[mode]} | {t[0]['local']:,} | {med(x['tok_s'] for x in t):,.0f} | {med(x['tok_s'] for x in b):,.0f} | "
            f"{med(ratios):.3f} | {', '.join(f'{r:.3f}' for r in ratios)} | {med(x['rss'] for x in t):,.0f} | "
            f"{med(x['rss'] for x in b):,.0f} | {min(loads[mode]):.1f}-{max(loads[mode]):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp", "tp"], choices=list(KEYS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    command = "python scripts/bench/mesh.py " + " ".join(sys.argv[1:])
    cells: dict[tuple[str, str], list[dict]] = {(r, m): [] for r in ("bare", "template") for m in args.modes}
    loads: dict[str, list[float]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="bench_mesh_") as tmp:
        for rep in range(args.repeats):
            for mode in args.modes:
                load = os.getloadavg()[0]
                for runner in ("bare", "template"):  # a pair, back to back
                    cells[(runner, mode)].append(launch(runner, mode, args.steps, Path(tmp)))
                loads[mode].append((load + os.getloadavg()[0]) / 2)
                b, t = cells[("bare", mode)][-1], cells[("template", mode)][-1]
                print(
                    f"repeat {rep + 1}: {mode:4s} bare {b['tok_s']:,.0f} tok/s, template {t['tok_s']:,.0f} tok/s "
                    f"({t['tok_s'] / b['tok_s']:.3f}), load {loads[mode][-1]:.1f}",
                    flush=True,
                )
    text = table(cells, args.modes, args.steps, args.repeats, loads, command.strip())
    print(text)
    if args.update_docs:
        update_docs(text, START, END, SECTION)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
