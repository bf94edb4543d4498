#!/usr/bin/env python3
"""The memory estimator against one GPU's allocator: live peak, reserved peak, and the estimate for each.

    python scripts/bench/gpu_memory.py              on a GPU: a 2.8B Llama, 2 x 8,192 tokens, four cells (estimated 69-92 GiB live), a few minutes on an H200
    python scripts/bench/gpu_memory.py --dry-run    anywhere: a tiny Llama on CPU (the figures mean nothing there)

Why: the estimator counts live tensors (checked within 0.95-1.08 of measured peaks on CPU, docs/BENCHMARKS.md), while
torchtitan's published figures, and what decides an out-of-memory, are the caching allocator's *reserved* memory:
live tensors plus its cached blocks and fragmentation. torchtitan's rows ran 4-23% above our estimates; how much of
that is the allocator needs a GPU. Each cell launches train.py once (a Llama written from a config.json, random
weights, synthetic data, bf16, AdamW) and reads its summary.json: `peak_memory_mb` (torch.cuda.max_memory_allocated)
and `peak_memory_reserved_mb` (max_memory_reserved); scripts/estimate_memory.py gives the estimate for the same keys.
The cells: full activation checkpointing with torch's default allocator and with `expandable_segments:True` (what
torchtitan's run_llama_train.sh sets), selective (op) and no checkpointing (expandable). Writes OUT/gpu_memory.md and
OUT/gpu_memory.json (OUT: --out, default runs/gpu_memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import BARE_RUN, REPO

from parallel_train.core.json_text import json_text

MIB = 2**20
# hidden, intermediate, layers, heads, kv heads, vocabulary, tokens per sample, samples per step
SHAPES = {"gpu": (4096, 14336, 8, 32, 8, 128256, 8192, 2), "dry": (64, 128, 2, 4, 2, 512, 64, 2)}
CELLS = {  # name -> (activation checkpointing, PYTORCH_CUDA_ALLOC_CONF)
    "full": ("full", ""),
    "full-expandable": ("full", "expandable_segments:True"),
    "selective-expandable": ("selective", "expandable_segments:True"),
    "none-expandable": ("none", "expandable_segments:True"),
}


def write_config(folder: Path, shape: tuple) -> None:
    """The Llama's config.json (no weights: the run starts from random ones, model.hf_pretrained=false)."""
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv, vocab, tokens, _ = shape
    shapes = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads)
    LlamaConfig(**shapes, num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=tokens, rope_theta=500000.0).save_pretrained(
        folder
    )


def keys(folder: Path, shape: tuple, mode: str, steps: int) -> list[str]:
    *_, vocab, tokens, batch = shape
    return [
        "model.name=hf",
        f"model.hf_path={folder}",
        "model.hf_pretrained=false",
        f"model.vocab_size={vocab}",
        f"model.block_size={tokens}",
        f"model.activation_checkpointing={mode}",
        "data.path=synthetic",
        f"data.num_samples={max(64, 4 * batch * steps)}",
        f"train.batch_size={batch}",
        "train.gradient_accumulation_steps=1",
        "train.mixed_precision=bf16",
        f"train.max_steps={steps}",
        f"train.lr_decay_steps={steps}",
        *BARE_RUN,
    ]


def run_cell(name: str, folder: Path, shape: tuple, steps: int, out: Path) -> dict:
    mode, alloc = CELLS[name]
    args = [*keys(folder, shape, mode, steps), f"output_dir={out / name}"]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc, "HF_HUB_OFFLINE": "1"}
    estimate = subprocess.run(
        [sys.executable, "scripts/estimate_memory.py", "--world", "1", "--json", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    start = time.time()
    run = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True)
    (out / f"{name}.log").write_text(run.stdout + run.stderr)
    summary_path = out / name / "summary.json"
    s = json.loads(summary_path.read_text()) if run.returncode == 0 and summary_path.exists() else {}
    est = json.loads(estimate.stdout)["ranks"][0]["total"] / MIB if estimate.returncode == 0 else None
    return {
        "cell": name,
        "checkpointing": mode,
        "allocator": alloc or "default",
        "status": "ok" if s else f"failed ({out / f'{name}.log'})",
        "seconds": round(time.time() - start, 1),
        "estimated_mb": est,
        "allocated_mb": s.get("peak_memory_mb"),
        "reserved_mb": s.get("peak_memory_reserved_mb"),
    }


def table(cells: list[dict], what: str) -> str:
    def ratio(a, b):
        return "-" if not a or not b else f"{a / b:.2f}"

    def mib(v):
        return "-" if v is None else f"{v:,.0f}"

    lines = [
        what,
        "",
        "| cell | checkpointing | allocator | estimated (MiB) | allocated peak | reserved peak | estimate / allocated | "
        "reserved / allocated | estimate / reserved | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        e, a, r = c["estimated_mb"], c["allocated_mb"], c["reserved_mb"]
        lines.append(
            f"| {c['cell']} | {c['checkpointing']} | {c['allocator']} | {mib(e)} | {mib(a)} | {mib(r)} | {ratio(e, a)} | "
            f"{ratio(r, a)} | {ratio(e, r)} | {c['status']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny Llama on CPU: rehearse the script, no GPU needed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_memory")
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated: " + ",".join(CELLS))
    a = parser.parse_args()
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU found; run with --dry-run to rehearse on CPU", file=sys.stderr)
        return 2
    names = [n.strip() for n in a.cells.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CELLS]:
        print(f"error: --cells: unknown {unknown}; known: {', '.join(CELLS)}", file=sys.stderr)
        return 2
    shape = SHAPES["dry" if a.dry_run else "gpu"]
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_config(out / "llama", shape)
    cells = []
    for name in names:
        cells.append(run_cell(name, out / "llama", shape, 2 if a.dry_run else a.steps, out))
        print(json_text(cells[-1]), flush=True)
    device = (
        "DRY RUN on CPU (allocated is host RSS, reserved absent: the figures mean nothing)" if a.dry_run else torch.cuda.get_device_name()
    )
    hidden, intermediate, layers, *_, vocab, tokens, batch = shape
    what = (
        f"{device}, torch {torch.__version__}; Llama {layers} layers x {hidden} (intermediate {intermediate}, vocabulary {vocab}), "
        f"{batch} x {tokens} tokens, bf16, AdamW; {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    text = table(cells, what)
    (out / "gpu_memory.md").write_text(text)
    (out / "gpu_memory.json").write_text(json_text({"dry_run": a.dry_run, "shape": shape, "cells": cells}, indent=1))
    print("\n" + text + f"\nwrote {out / 'gpu_memory.md'} and {out / 'gpu_memory.json'}")
    return 0 if all(c["status"] == "ok" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
