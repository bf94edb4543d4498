#!/usr/bin/env python3
"""The floor: a minimal hand-written training loop of the template's model, no framework.

Same config keys, same model class, same initial weights, same batches (the template's global batch
order), same AdamW groups and learning-rate schedule, same gradient clipping as `train.py`; no
Accelerate, no DataLoader, no evaluation, no checkpoints, no trackers. `scripts/bench/benchmark.py` runs it
side by side with `train.py` to measure what the template costs. Character corpus only. Under torchrun it
is a bare DDP loop (plain torch DDP over gloo): the floor for data-parallel scaling on this machine; with
--mode fsdp a bare FSDP2 loop (`fully_shard` per block and on the root), with --mode tp a bare tensor-parallel
loop (`parallelize_module` with the model's own plan; every rank reads the same batch), for scripts/bench/mesh.py.

    python scripts/bench/bare_loop.py --config configs/shakespeare_char_cpu.yaml train.max_steps=300
    torchrun --nproc-per-node 2 scripts/bench/bare_loop.py --config configs/shakespeare_char_cpu.yaml
    torchrun --nproc-per-node 2 scripts/bench/bare_loop.py --mode fsdp ...      (or --mode tp)
    python scripts/bench/bare_loop.py --keep-freed-memory ...   with the template's malloc setting (observe/perf.py)

Prints one JSON line: steady-state tokens/s (first log interval left out, as train.py does) and the
loss at every log step (these match train.py's metrics.jsonl: same data, same arithmetic; under DDP
rank 0's own loss), and the peak RSS of every rank. tokens/s counts every data-parallel rank (tensor-parallel
ranks share their batch).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parallel_train.config.load import load_config  # noqa: E402
from parallel_train.data.batch_sampler import GlobalBatchSampler  # noqa: E402
from parallel_train.models.gpt import GPT  # noqa: E402
from parallel_train.observe.perf import set_host_allocator  # noqa: E402
from parallel_train.optim import build_optimizer, lr_at  # noqa: E402
from parallel_train.parallel.model_init import start_model  # noqa: E402


def main(argv: list[str]) -> None:
    if "--keep-freed-memory" in argv:  # the one host-side setting train.py makes (perf.set_host_allocator; DDP's)
        argv = [a for a in argv if a != "--keep-freed-memory"]
        set_host_allocator()
    mode = "ddp"
    if "--mode" in argv:
        i = argv.index("--mode")
        mode, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    cfg, _ = load_config(argv)
    m, t = cfg.model, cfg.train
    text = Path(cfg.data.path).read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    train_ids = ids[: len(ids) - int(len(ids) * cfg.data.val_fraction)]
    offsets = torch.arange(m.block_size + 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    dp, dp_rank = (1, 0) if mode == "tp" else (world, rank)
    sampler = GlobalBatchSampler(len(train_ids) - m.block_size, t.batch_size, dp, dp_rank, t.seed)

    # The template's first weights: each module drawn under a seed keyed by its name (parallel/model_init.py), so
    # both loops start equal; then the dropout stream train.py seeds per rank.
    model, init = start_model(GPT, m, max(len(chars), m.vocab_size), t.seed)
    init.fill(model, torch.device("cpu"))
    torch.manual_seed(t.seed + 1 + rank)
    if world > 1 and mode != "ddp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        if mode == "tp":
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh, model.tensor_parallel_plan(world))
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, t)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 and mode == "ddp" else model
    ddp.train()

    losses, t_steady = {}, None
    for step in range(t.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        for micro in range(t.gradient_accumulation_steps):
            windows = train_ids[torch.as_tensor(sampler.indices_at(step * t.gradient_accumulation_steps + micro)).unsqueeze(1) + offsets]
            x, y = windows[:, :-1], windows[:, 1:]
            last = micro == t.gradient_accumulation_steps - 1
            with ddp.no_sync() if ddp is not model and not last else contextlib.nullcontext():  # all-reduce once per step
                logits = ddp(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / t.gradient_accumulation_steps
                loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % t.log_interval == 0 or done == t.max_steps:
            losses[done] = loss.item() * t.gradient_accumulation_steps  # the only sync, as in train.py
            if t_steady is None:
                t_steady = time.perf_counter()  # the first interval holds warm-up; leave it out
    elapsed = time.perf_counter() - t_steady
    steady_steps = t.max_steps - t.log_interval
    tok_s = dp * steady_steps * t.batch_size * t.gradient_accumulation_steps * m.block_size / elapsed
    rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]  # MB (KiB on Linux)
    if world > 1:
        rss = [None] * world
        torch.distributed.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print(json.dumps({"tokens_per_sec": tok_s, "step_time_s": elapsed / steady_steps, "losses": losses, "peak_rss_mb": rss}))
    if world > 1:
        del model, ddp, optimizer  # sharded state freed before its process group (see scripts/bench/checkpoint.py)
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
