#!/usr/bin/env python3
"""Checkpoint saves of a ~100M-parameter GPT on several processes: gathered (the format before sharded saves) vs
sharded vs sharded in the background. Time the training loop is blocked, and rank 0's extra host memory.

    python scripts/bench/checkpoint.py                    2 CPU processes, 12 x 768 GPT, vocab 8192 (98M parameters)
    python scripts/bench/checkpoint.py --update-docs      also put the table into docs/BENCHMARKS.md
    python scripts/bench/checkpoint.py --layers 2 --width 128 --repeats 1      a quick try

Each (mode, repeat) is a fresh `torchrun` launch of this script (`--worker`): every rank builds the same model
with AdamW, takes one optimizer step (so the optimizer state exists), then saves `--saves` times. A DDP run's
state: every rank holds all of it. Per save, on every rank: wall time until the loop could train again
(`blocking`), until the checkpoint was sealed (`total`), and the peak of VmRSS above its value before the save
(VmHWM, reset through /proc/self/clear_refs before each save). Modes:

    gathered  what checkpoint.save did before sharded saves (commit d1d89bc): rank 0 writes the whole model and
              optimizer state and hashes every file; the other ranks wait (copied below, so it stays measurable)
    sharded   checkpoint.Checkpointer: every rank writes its part, replicated tensors once (DCP)
    async     the same with checkpoint.async=true: the loop waits for a copy of the state; a thread writes it

Each mode runs with the state replicated (DDP: every rank holds all of it) and sharded (FSDP2 `fully_shard` over a
CPU mesh). Then train.py runs of the same model (sync and async, a checkpoint every step and every 2 steps) give
summary.json's checkpoint_blocking_s.

Writes OUT/bench_checkpoint.json and OUT/bench_checkpoint.md; OUT defaults to runs/bench_checkpoint. The 1-minute
load average is recorded next to every figure: on a shared machine it says how far to trust it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, update_docs

from parallel_train.core.json_text import json_text  # JSON without NaN (null instead)

DOC_START, DOC_END = "<!-- bench_checkpoint:start -->", "<!-- bench_checkpoint:end -->"
MODES = ("gathered", "sharded", "async")
SHARDINGS = {"ddp": "DDP (replicated)", "fsdp": "FSDP2 (sharded)"}


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- the save before sharded checkpoints (d1d89bc)


def gathered_save(folder: Path, model, optimizer, rank: int) -> None:
    """checkpoint.save as of d1d89bc: the whole model (accelerate's get_state_dict: under FSDP2 a full, CPU-offloaded
    state dict on rank 0) and the optimizer state gathered tensor by tensor and kept on rank 0, which writes
    model.safetensors and optimizer.safetensors and hashes every file for the manifest; every rank its RNG file."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    tmp = folder.with_name(".tmp-" + folder.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    save_file({"cpu": torch.get_rng_state()}, str(tmp / f"rng_rank{rank}.safetensors"))
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        model_state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors = {}
    for i, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            full = v.full_tensor() if isinstance(v, DTensor) else v  # a collective: every rank gathers ...
            if rank == 0:  # ... and only the writer keeps it
                tensors[f"{names[id(params[i])]}/{k}"] = full.detach().contiguous().cpu()
    if rank == 0:
        save_file(model_state, str(tmp / "model.safetensors"))
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": 1}))
    dist.barrier()
    if rank == 0:
        files = {}
        for p in sorted(tmp.iterdir()):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            files[p.name] = {"size": p.stat().st_size, "sha256": h.hexdigest()}
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        (tmp / "manifest.json").write_text(json.dumps({"files": files}))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    dist.barrier()


# ---------------------------------------------------------------- one launch: --worker MODE


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from parallel_train.checkpoint.checkpointer import Checkpointer, checkpoint_name
    from parallel_train.checkpoint.named_state import RankState
    from parallel_train.config.sections import TrainConfig
    from parallel_train.losses import loss_fn
    from parallel_train.models.gpt import GPT, Block, GPTConfig
    from parallel_train.optim import build_optimizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=max(1, args.width // 64), n_embd=args.width, block_size=64, dropout=0.0), args.vocab)
    if args.sharding == "fsdp":  # FSDP2 over a CPU mesh, each Block its own unit (what accelerate_configs/fsdp.yaml does)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, TrainConfig())
    x = torch.randint(0, args.vocab, (2, 65))
    loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())  # DTensor numel: the whole tensor's
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    root = Path(args.dir)
    saver = None if args.worker == "gathered" else Checkpointer(root, keep=1, background=args.worker == "async", timeout_s=600)
    saves = []
    for step in range(1, args.saves + 1):
        gc.collect()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of this save alone
        before, load = rss_kib("VmRSS"), os.getloadavg()[0]
        t0 = time.perf_counter()
        if saver is None:
            gathered_save(root / checkpoint_name(step), model, optimizer, rank)
            blocking = time.perf_counter() - t0
        else:
            saver.write(step, RankState(model.state_dict(), model, optimizer), {"trainer_state.json": json.dumps({"step": step})})
            blocking = time.perf_counter() - t0
            saver.wait()  # not finish(): as in a run, the host copy's buffers stay for the next background save
        total = time.perf_counter() - t0
        saves.append({"blocking_s": blocking, "total_s": total, "extra_rss_mb": (rss_kib("VmHWM") - before) / 1024, "load": load})
    if saver is not None:
        saver.finish()
    parts = [None] * world if rank == 0 else None
    dist.gather_object(saves, parts, dst=0)
    if rank == 0:
        result = {
            "mode": args.worker,
            "sharding": args.sharding,
            "world": world,
            "params": params,
            "state_mb": state_bytes / 2**20,
            "ranks": parts,
        }
        Path(args.json).write_text(json_text(result))
    # Free the sharded model before the process group goes: left to interpreter shutdown, FSDP2's state on gloo
    # aborts the process now and then ("terminate called without an active exception", tests/fsdp_worker.py).
    del model, optimizer, saver
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the parent: launches, table


def launch(mode: str, sharding: str, args: argparse.Namespace, out: Path) -> dict:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(args.nproc), __file__, "--worker", mode, "--sharding", sharding]
        cmd += ["--dir", str(Path(tmp) / "checkpoints"), "--json", str(result_file), "--saves", str(args.saves)]
        cmd += ["--layers", str(args.layers), "--width", str(args.width), "--vocab", str(args.vocab)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{sharding} {mode}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return json.loads(result_file.read_text())


def train_py(background: bool, interval: int, args: argparse.Namespace, out: Path) -> dict:
    """The same model through train.py (synthetic data, a checkpoint every `interval` steps, `args.saves` + 1 of
    them): summary.json's checkpoint_blocking_s, the training loop's own count."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        run, total = Path(tmp) / "run", interval * (args.saves + 1)
        model = [f"model.n_layer={args.layers}", f"model.n_head={max(1, args.width // 64)}", f"model.n_embd={args.width}"]
        model += ["model.block_size=64", f"model.vocab_size={args.vocab}", "model.dropout=0.0"]
        steps = [f"train.max_steps={total}", "train.warmup_steps=0", f"train.lr_decay_steps={total}", "train.batch_size=1"]
        rest = ["data.path=synthetic", "data.num_samples=20000", f"checkpoint.interval={interval}", "checkpoint.keep=1"]
        rest += ["eval.interval=0", "eval.iters=1", "tracker=none", f"checkpoint.async={str(background).lower()}", f"output_dir={run}"]
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(args.nproc), "train.py", *model, *steps, *rest]
        load = os.getloadavg()[0]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"train.py: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        summary = json.loads((run / "summary.json").read_text())
        return {"async": background, "interval": interval, "saves": args.saves + 1, "load": (load + os.getloadavg()[0]) / 2, **summary}


def table(runs: list[dict], args: argparse.Namespace) -> str:
    first = runs[0]
    lines = [
        f"GPT {args.layers} x {args.width}, vocab {args.vocab}: {first['params'] / 1e6:.0f}M parameters; model + AdamW state "
        f"{first['state_mb']:,.0f} MB in all (under DDP every rank holds all of it, under FSDP2 1/{args.nproc}); "
        f"{args.nproc} CPU processes (gloo), {args.saves} saves per launch x {args.repeats} launches per row; times: medians "
        "over every save; memory: the largest peak above the RSS before the save (async: the first save allocates the host "
        "copy, which later saves reuse).",
        "",
        "| sharding | save | loop blocked per save (rank 0) | save until sealed (rank 0) | rank 0 extra host memory | "
        "other ranks' extra memory | 1-min load |",
        "|---|---|---|---|---|---|---|",
    ]
    for sharding, mode in [(s, m) for s in SHARDINGS for m in MODES]:
        mine = [r for r in runs if r.get("mode") == mode and r.get("sharding") == sharding]
        if not mine:
            continue
        rank0 = [s for r in mine for s in r["ranks"][0]]
        others = [s for r in mine for part in r["ranks"][1:] for s in part]
        load = [s["load"] for s in rank0]
        lines.append(
            f"| {SHARDINGS[sharding]} | {mode} | {statistics.median(s['blocking_s'] for s in rank0):.2f} s | {statistics.median(s['total_s'] for s in rank0):.2f} s | "
            f"{max(s['extra_rss_mb'] for s in rank0):,.0f} MB | {max((s['extra_rss_mb'] for s in others), default=0):,.0f} MB | "
            f"{min(load):.1f}-{max(load):.1f} |"
        )
    trainer = [r for r in runs if "checkpoint_blocking_s" in r]
    if trainer:
        lines += [
            "",
            f"Through train.py (`torchrun --nproc-per-node {args.nproc} train.py`, the same model, synthetic data, batch 1 x 64 "
            f"tokens, {trainer[0]['saves']} checkpoints): summary.json's figures.",
            "",
            "| checkpoint.async | checkpoint.interval | checkpoint_blocking_s (all saves) | per save | checkpoint_drain_s | wall time | 1-min load |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in trainer:
            lines.append(
                f"| {str(r['async']).lower()} | {r['interval']} | {r['checkpoint_blocking_s']:.2f} s | "
                f"{r['checkpoint_blocking_s'] / r['saves']:.2f} s | {r['checkpoint_drain_s']:.2f} s | {r['wall_time_s']:.0f} s | {r['load']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc-per-node)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--saves", type=int, default=3, help="saves per launch")
    p.add_argument("--repeats", type=int, default=2, help="launches per mode (round-robin over the modes)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--shardings", default=",".join(SHARDINGS), help="ddp: every rank holds the whole state; fsdp: FSDP2 shards it")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_checkpoint")
    p.add_argument("--no-train-py", action="store_true", help="skip the two train.py runs (sync, async)")
    p.add_argument("--update-docs", action="store_true", help="replace the table in docs/BENCHMARKS.md")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--sharding", choices=tuple(SHARDINGS), default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):  # round-robin: a change in machine load hits every row alike
        for sharding in args.shardings.split(","):
            for mode in args.modes.split(","):
                runs.append(launch(mode, sharding, args, args.out))
                print(f"repeat {repeat + 1}: {sharding} {mode} done", flush=True)
    # A checkpoint every step, then every 2 steps: a background write that takes longer than the steps between
    # saves makes the next save wait for it.
    for interval, background in () if args.no_train_py else ((1, False), (1, True), (2, False), (2, True)):
        runs.append(train_py(background, interval, args, args.out))
        print(f"train.py checkpoint.async={background} checkpoint.interval={interval} done", flush=True)
    (args.out / "bench_checkpoint.json").write_text(json_text(runs, indent=1))
    text = table(runs, args) + f"\n\nCommand: `python scripts/bench/checkpoint.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`."
    (args.out / "bench_checkpoint.md").write_text(text + "\n")
    print(text)
    if args.update_docs:
        update_docs(text.replace(" --update-docs", ""), DOC_START, DOC_END)


if __name__ == "__main__":
    main()
