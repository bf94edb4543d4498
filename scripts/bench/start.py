#!/usr/bin/env python3
"""Start memory of a ~300M-parameter GPT: one process against FSDP2 over 2 and 4 CPU processes (torchrun).

    python scripts/bench/start.py                  24 x 1024 GPT (302M parameters), 1 step per launch
    python scripts/bench/start.py --update-docs    also put the table into docs/BENCHMARKS.md
    python scripts/bench/start.py --repo DIR       measure another checkout of the template (e.g. before a change)

Every launch trains one optimizer step (AdamW, so its state exists) and reports from rank 0's summary.json:
the peak RSS when the first step is done (`peak_memory_at_first_step_mb`: the model built, cut, filled, one step
taken), the peak over the whole run (`peak_memory_mb`, with the final checkpoint and export), and the time from
process start to the end of the first step; and the first-step peak again with glibc told to hand freed memory
back at once (RETURN_FREED below): what was live rather than what the allocator kept. A tiny model on the same
launch gives the runtime's fixed cost (torch, accelerate, the process group). The goal (issue "One engine"): with the meta-device start, rank 0's first-step peak
is at most 1/dp_shard of the one-process model + optimizer memory (16 bytes per parameter: weights, gradients, two
AdamW moments) plus that fixed cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BARE_RUN, REPO, free_port, update_docs

START, END = "<!-- start_memory:start -->", "<!-- start_memory:end -->"
COMMON = ("model.n_head=16", "model.block_size=64", "train.batch_size=4", "train.max_steps=1", *BARE_RUN)
BIG, TINY = ("model.n_layer=24", "model.n_embd=1024"), ("model.n_layer=2", "model.n_embd=64")


# glibc told to hand freed memory back at once (the template then leaves its own thresholds: observe/perf.py), so
# that the peak RSS is what was live, not what the allocator kept for the next step.
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def launch(repo: Path, processes: int, model: tuple[str, ...], tmp: Path, extra_env: dict | None = None) -> dict:
    out = tmp / f"run_{processes}_{len(os.listdir(tmp))}"
    args = [*COMMON, *model, f"output_dir={out}"]
    if processes > 1:
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--nproc-per-node", str(processes), "--master-port", str(free_port()), "train.py", *args]
        cmd.append(f"parallel.dp_shard={processes}")
    else:
        cmd = [sys.executable, "train.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), WANDB_MODE="disabled", PYTHONUNBUFFERED="1", **(extra_env or {}))
    result = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {
        "processes": processes,
        "start_mb": s.get("peak_memory_mb_after_start"),  # absent in checkouts older than the meta start
        "first_step_mb": s.get("peak_memory_mb_at_first_step"),
        "peak_mb": s["peak_memory_mb"],
        "first_step_s": s["time_to_first_step_s"],
    }


def mb(value: float | None) -> str:
    return f"{value:,.0f} MB" if value else "n/a"


def table(rows: dict[str, dict], fixed: float, freed: dict[str, dict], fixed_freed: float, params: int) -> str:
    state_mb = 16 * params / 2**20  # weights, gradients, two AdamW moments, fp32
    weights_mb = 4 * params / 2**20
    lines = [
        "| layout | rank 0 after the start (weights in place) | weights/dp + fixed | rank 0 at the first step | "
        "state/dp + fixed (the goal) | the same, freed memory returned at once | its goal | whole run | time to first step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        dp, f = r["processes"], freed.get(name, {})
        lines.append(
            f"| {name} | {mb(r['start_mb'])} | {mb(weights_mb / dp + fixed)} | {mb(r['first_step_mb'])} | "
            f"{mb(state_mb / dp + fixed)} | {mb(f.get('first_step_mb'))} | {mb(state_mb / dp + fixed_freed)} | "
            f"{mb(r['peak_mb'])} | {r['first_step_s']:.1f} s |"
        )
    return "\n".join(lines) + (
        f"\n\nModel + optimizer state in one process: {state_mb:,.0f} MB ({params / 1e6:.0f}M parameters x 16 bytes; the "
        f"weights alone {weights_mb:,.0f} MB). Fixed cost: rank 0 of a 2-layer, 64-wide model on 2 processes, {fixed:,.0f} MB "
        f"({fixed_freed:,.0f} MB with freed memory returned at once: {' '.join(f'{k}={v}' for k, v in RETURN_FREED.items())})."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py runs")
    parser.add_argument("--layouts", default="1,2,4", help="processes per launch (1: one process; N: dp_shard=N)")
    parser.add_argument("--update-docs", action="store_true")
    a = parser.parse_args()
    from parallel_train.models.gpt import GPT, GPTConfig
    from parallel_train.parallel.model_init import parameters_on_meta

    with parameters_on_meta():
        params = sum(p.numel() for p in GPT(GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=64), 65).parameters())
    rows, freed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny, tiny_freed = launch(a.repo, 2, TINY, Path(tmp)), launch(a.repo, 2, TINY, Path(tmp), RETURN_FREED)
        fixed = tiny["first_step_mb"] or tiny["peak_mb"]
        fixed_freed = tiny_freed["first_step_mb"] or tiny_freed["peak_mb"]
        for n in map(int, a.layouts.split(",")):
            name = "1 process" if n == 1 else f"{n}x FSDP2 (dp_shard={n})"
            rows[name] = launch(a.repo, n, BIG, Path(tmp))
            freed[name] = launch(a.repo, n, BIG, Path(tmp), RETURN_FREED)
            print(name, rows[name], freed[name], flush=True)
    text = table(rows, fixed, freed, fixed_freed, params)
    print(text)
    if a.update_docs:
        update_docs(text, START, END)


if __name__ == "__main__":
    main()
