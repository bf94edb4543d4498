#!/usr/bin/env python3
"""The memory estimator against a measurement: two real training steps of one process, its peak of live
tensor memory, beside scripts/estimate_memory.py's total for the same keys.

    python scripts/bench/memory_estimate.py model.n_layer=4 model.n_embd=256 model.n_head=4 model.block_size=256 train.batch_size=8
    python scripts/bench/memory_estimate.py --config configs/gpt2_124m.yaml train.batch_size=4   # on a GPU

On a GPU the measurement is torch.cuda.max_memory_allocated over the second step; on the CPU, where torch keeps
no allocator statistics, torch's own MemTracker (torch.distributed._tools.mem_tracker: every tensor storage
created and freed) over the second step. Both count tensors only (no CUDA context, no allocator cache): what
the estimate predicts. The step is the template's: its model, AdamW groups, loss, autocast, gradient
accumulation (train.gradient_accumulation_steps micro-steps), activation checkpointing; one process, no mesh.
Prints one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # run from a clone, no install step

from parallel_train.errors import run_cli  # noqa: E402


def main() -> int:
    import torch

    from parallel_train.config.load import load_config
    from parallel_train.data.sources import load_data
    from parallel_train.losses import loss_fn
    from parallel_train.models import build_model
    from parallel_train.optim import build_optimizer
    from parallel_train.parallel.memory_estimate import estimate

    cfg, _ = load_config(sys.argv[1:])
    data = load_data(cfg)
    x0, y0 = data.train_set[0]
    _, ranks = estimate(cfg, 1, data.vocab_size, (x0, y0))
    predicted = ranks[0].total()  # as the run keeps them: its own model.activation_checkpointing

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, data.vocab_size).to(device).train()
    optimizer = build_optimizer(model, cfg.train)
    x, y = (torch.stack([t] * cfg.train.batch_size).to(device) for t in (x0, y0))
    precision = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else "no"
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def step() -> None:
        for _ in range(cfg.train.gradient_accumulation_steps):
            with amp:
                loss = loss_fn(model(x), y)
            (loss / cfg.train.gradient_accumulation_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as after a run's first step
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        measured, how = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            step()
        measured, how = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"], "MemTracker peak (CPU)"
    r = ranks[0]
    print(
        json.dumps(
            {
                "measured_bytes": measured,
                "measured_by": how,
                "estimated_bytes": predicted,
                "estimate_over_measured": round(predicted / measured, 3),
                "estimate": {k: getattr(r, k) for k in ("params", "grads", "optimizer", "working", "activations", "activations_ckpt")},
            }
        )
    )
    return 0


if __name__ == "__main__":
    run_cli(main)
