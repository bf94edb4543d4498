#!/usr/bin/env python3
"""Fine-tuning, measured on this CPU: LoRA against full fine-tuning, packed against padded chat samples.

    python scripts/bench/finetune.py                  # about 15 minutes on 2 cores
    python scripts/bench/finetune.py --update-docs    # also write the table into docs/BENCHMARKS.md
    python scripts/bench/finetune.py --table-only     # the table again from WORK/bench_finetune.json

One model for every cell: a 4-layer Llama, 256 wide, 512 ids (scripts/make_tiny_chat_model.py, random weights),
and 2,000 conversations of one to three exchanges (mixed lengths: a packed row holds several). Each cell is
`python train.py` on 1 process with 1 thread, batch 8, model.block_size=512, chat data (loss on the assistant's
tokens only), AdamW, launched twice: --short and --long optimizer steps. The cells run round-robin, --repeats
times.

Why CPU time: this machine is shared, and other people's work changes wall-clock speed several-fold within
minutes. The CPU time a one-thread process spends (user + system, from wait4) barely depends on that. The
difference between the long and the short launch of a cell is the cost of (long - short) steady-state steps:
start-up, evaluation, the final checkpoint and export are in both and cancel. From it:
- positions per CPU-second: every position of the batches, padding included;
- sample tokens per CPU-second: only the positions that hold a sample's token (what an epoch costs), counted here
  from the same data and the same batches the runs drew (padded: each batch padded to its longest, a multiple of
  8; packed: rows of 512 planned by best-fit decreasing);
- tokens/s (wall) is summary.json's for the long launch, printed for reference with the load next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, update_docs  # scripts/bench/common.py: the benchmarks' shared part (puts REPO/src on sys.path)

from parallel_train.core.json_text import json_text  # JSON without NaN (null instead)

PYTHON = sys.executable
DOC_START, DOC_END = "<!-- bench_finetune:start -->", "<!-- bench_finetune:end -->"
CELLS = {  # name: (what, keys)
    "full_padded": ("full fine-tuning, padded", ("data.packing=false",)),
    "lora_padded": ("LoRA rank 8 (q_proj, v_proj), padded", ("model.lora_rank=8", "data.packing=false")),
    "full_packed": ("full fine-tuning, packed", ("data.packing=true",)),
    "lora_packed": ("LoRA rank 8 (q_proj, v_proj), packed", ("model.lora_rank=8", "data.packing=true")),
}
BATCH, BLOCK = 8, 512


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def common(work: Path, steps: int) -> list[str]:
    return [
        "model.name=hf",
        f"model.hf_path={work / 'model'}",
        f"model.block_size={BLOCK}",
        "data.format=chat",
        f"data.path={work / 'chats.jsonl'}",
        "data.truncate=true",
        f"train.batch_size={BATCH}",
        f"train.max_steps={steps}",
        "train.warmup_steps=2",
        f"train.lr_decay_steps={steps}",
        "train.learning_rate=3e-4",
        "train.log_interval=10",
        "eval.interval=0",
        "eval.iters=1",
        "checkpoint.interval=0",
        "tracker=none",
        "resume=none",
    ]


def launch(work: Path, name: str, steps: int) -> dict:
    """One launch of a cell: its CPU seconds (user + system, wait4), summary.json, its checkpoint's size."""
    out = work / f"{name}_{steps}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    cmd = [PYTHON, "train.py", *common(work, steps), *CELLS[name][1], f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{output[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    checkpoint = next((out / "checkpoints").iterdir())
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return {**summary, "cpu_s": usage.ru_utime + usage.ru_stime, "checkpoint_bytes": size, "load": os.getloadavg()[0]}


def positions(work: Path, packing: bool, steps: int) -> tuple[int, int]:
    """(positions, sample tokens) of the first `steps` batches a run draws (its seed, its sampler, its data)."""
    from parallel_train.config.load import load_config
    from parallel_train.data.batch_sampler import GlobalBatchSampler
    from parallel_train.data.sources import load_data

    cfg, _ = load_config([*common(work, steps), f"data.packing={str(packing).lower()}"])
    data = load_data(cfg)
    sampler = GlobalBatchSampler(len(data.train_set), BATCH, 1, 0, cfg.train.seed, start_micro_step=0, order=data.order)
    seen = real = 0
    for step, indices in enumerate(sampler):
        if step == steps:
            break
        y = data.train_set.__getitems__(indices)[1]
        rows = [data.train_set.rows[i] for i in indices] if packing else [[i] for i in indices]
        seen += y.numel()
        real += sum(int(data.train_set.samples.lengths[i]) - 1 for row in rows for i in row)
    return seen, real


def cell_figures(pair: dict, counts: dict) -> dict:
    """Per repeat: positions and sample tokens per CPU-second of the steps the long launch has beyond the short."""
    (seen_long, real_long), (seen_short, real_short) = counts["long"], counts["short"]
    cpu = pair["long"]["cpu_s"] - pair["short"]["cpu_s"]
    return {"positions_per_cpu_s": (seen_long - seen_short) / cpu, "samples_per_cpu_s": (real_long - real_short) / cpu}


def table(saved: dict) -> str:
    results, counts = saved["results"], saved["counts"]

    def kind(name: str) -> str:
        return "true" if "packed" in name else "false"  # the counts' key: data.packing

    figures = {name: [cell_figures(pair, counts[kind(name)]) for pair in runs] for name, runs in results.items()}
    lines = [
        f"Measured {saved['when']} by `python scripts/bench/finetune.py --short {saved['short']} --long {saved['long']} "
        f"--repeats {saved['repeats']}` (1 process, 1 thread; load = the machine's 1-minute load average during the long launch).",
        "",
        "| cell | padding share | positions per CPU-s | sample tokens per CPU-s | vs full, padded | tokens/s (wall, load) | trainable | checkpoint | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        seen, real = counts[kind(name)]["long"]
        per_cpu = statistics.median(f["positions_per_cpu_s"] for f in figures[name])
        samples_cpu = statistics.median(f["samples_per_cpu_s"] for f in figures[name])
        ratio = statistics.median(
            f["samples_per_cpu_s"] / b["samples_per_cpu_s"] for f, b in zip(figures[name], figures["full_padded"], strict=True)
        )
        longs = [pair["long"] for pair in runs]
        wall = ", ".join(f"{r['tokens_per_sec'] or 0:,.0f} ({r['load']:.1f})" for r in longs)  # None: too few steps to tell
        r = longs[0]
        lines.append(
            f"| {CELLS[name][0]} | {100 * (1 - real / seen):.1f}% | {per_cpu:,.0f} | {samples_cpu:,.0f} | {ratio:.2f}x | {wall} | "
            f"{r['trainable_params']:,} of {r['total_params']:,} | {statistics.median(p['checkpoint_bytes'] for p in longs) / 1e6:.2f} MB | "
            f"{statistics.median(p['peak_memory_mb'] for p in longs):,.0f} MB |"
        )
    return "\n".join(lines)


def report(text: str, update: bool) -> None:
    print(text)
    if update:
        update_docs(text, DOC_START, DOC_END)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_finetune"))
    p.add_argument("--short", type=int, default=10, help="optimizer steps of the short launch")
    p.add_argument("--long", type=int, default=50, help="optimizer steps of the long launch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--update-docs", action="store_true")
    p.add_argument("--table-only", action="store_true", help="rebuild the table from WORK/bench_finetune.json (no launches)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    record = args.work / "bench_finetune.json"
    if args.table_only:
        report(table(json.loads(record.read_text())), args.update_docs)
        return
    make = [PYTHON, "scripts/make_tiny_chat_model.py", str(args.work / "model"), str(args.work / "chats.jsonl")]
    subprocess.run([*make, "--layers", "4", "--width", "256", "--conversations", "2000"], cwd=REPO, env=env(), check=True)
    lengths = {"short": args.short, "long": args.long}
    counts = {str(packed).lower(): {k: positions(args.work, packed, s) for k, s in lengths.items()} for packed in (False, True)}
    results: dict[str, list[dict]] = {name: [] for name in CELLS}
    for _ in range(args.repeats):
        for name in CELLS:
            pair = {k: launch(args.work, name, s) for k, s in lengths.items()}
            results[name].append(pair)
            print(name, f"{pair['long']['cpu_s'] - pair['short']['cpu_s']:.1f} CPU-s for {args.long - args.short} steps", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    saved = {"results": results, "counts": counts, "when": when, "short": args.short, "long": args.long, "repeats": args.repeats}
    record.write_text(json_text(saved, indent=1))
    report(table(saved), args.update_docs)


if __name__ == "__main__":
    main()
