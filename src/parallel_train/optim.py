"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from parallel_train.config.sections import TrainConfig

FUSED_DEVICES = ("cpu", "cuda")  # where torch.optim.AdamW(fused=True) has a kernel (and this template runs)


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (embeddings, Linear weights); biases and norms undecayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel over every parameter, on the GPU and on the CPU alike. Against the default (foreach) it needs no
    # temporaries the size of the parameters (foreach's step peaks about 40% of the parameters' bytes higher) and
    # steps several times faster on the CPU (docs/BENCHMARKS.md, "Speed features"). None: wherever torch has the
    # kernel for every parameter's device.
    if fused is None:
        fused = all(p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr at lr_decay_steps, then min_lr (nanoGPT's schedule)."""
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    if step > cfg.lr_decay_steps:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Steps once per optimizer step. Not passed to accelerator.prepare: accelerate's wrapper would step
    it once per process per step (num_processes times) unless batches are split."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.learning_rate)
