"""Optimizer and learning-rate schedule.

Which parameters decay (`train.weight_decay_params`): `matrices` (every parameter of 2+ dimensions: embeddings and Linear
weights; biases and norm weights stay undecayed, close to transformers' Trainer), or `all` (one group, as plain
`torch.optim.AdamW(model.parameters())` does). The schedules (`train.lr_schedule`) are functions of the step only,
so every rank and a resumed run compute the same rate without a collective; docs/configuration.md#optimizer-and-schedule
draws them and compares the defaults with torch's AdamW and transformers' Trainer.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from parallel_train.config.sections import TrainConfig

FUSED_DEVICES = ("cpu", "cuda")  # where torch.optim.AdamW(fused=True) has a kernel (and this template runs)


def param_groups(params: list[nn.Parameter], cfg: TrainConfig) -> list[dict]:
    """AdamW's groups: with train.weight_decay_params=matrices, weight decay on parameters of 2+ dimensions only (decay pulls a
    norm's gain or a bias towards 0, which limits no weight matrix); with all, one group that decays every one."""
    if cfg.weight_decay_params == "all":
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over param_groups (above), or plain SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate)
    # fused: one kernel over every parameter, on the GPU and on the CPU alike. Against the default (foreach) it needs no
    # temporaries the size of the parameters (foreach's step peaks about 40% of the parameters' bytes higher) and
    # steps several times faster on the CPU (docs/BENCHMARKS.md, "Speed features"). None: wherever torch has the
    # kernel for every parameter's device.
    if fused is None:
        fused = all(p.device.type in FUSED_DEVICES for p in params)
    groups = param_groups(params, cfg)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def decay_start(cfg: TrainConfig) -> int:
    """wsd: the step its decay begins, lr_decay_fraction x lr_decay_steps before lr_decay_steps (never inside the warm-up)."""
    return max(cfg.warmup_steps, cfg.lr_decay_steps - round(cfg.lr_decay_fraction * cfg.lr_decay_steps))


def decay_progress(step: int, start: int, end: int) -> float:
    """0 at `start`, 1 at `end`."""
    return max(0.0, min(1.0, (step - start) / max(1, end - start)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based). Every schedule but constant warms up linearly over
    warmup_steps, reaches min_lr at lr_decay_steps and stays there:
    cosine  half a cosine from learning_rate down to min_lr (nanoGPT's schedule)
    linear  a straight line down to min_lr (transformers' linear schedule goes to 0: min_lr=0 for that)
    wsd     warmup-stable-decay: learning_rate until decay_start, then a straight line down to min_lr
    The warm-up is transformers' to the step: step s < warmup_steps runs at s / warmup_steps of the way up, so step 0
    at 0 (get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup), wsd's from min_lr (get_wsd_schedule)."""
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if step < cfg.warmup_steps:
        floor = cfg.min_lr if cfg.lr_schedule == "wsd" else 0.0
        return floor + (cfg.learning_rate - floor) * step / cfg.warmup_steps
    if step > cfg.lr_decay_steps:
        return cfg.min_lr
    start = decay_start(cfg) if cfg.lr_schedule == "wsd" else cfg.warmup_steps
    if step < start:
        return cfg.learning_rate
    done = decay_progress(step, start, cfg.lr_decay_steps)
    left = 0.5 * (1.0 + math.cos(math.pi * done)) if cfg.lr_schedule == "cosine" else 1.0 - done
    return cfg.min_lr + left * (cfg.learning_rate - cfg.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Steps once per optimizer step. Not passed to accelerator.prepare: accelerate's wrapper would step
    it once per process per step (num_processes times) unless batches are split."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.learning_rate)


def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, empty: bool) -> None:
    """The schedule's step after each optimizer step; also after a step with no token to learn (`empty`: no update was
    taken, step.py), whose rate the schedule moves past as planned."""
    if not empty:
        scheduler.step()
        return
    with warnings.catch_warnings():  # torch's warning of a schedule stepped before its optimizer: here that is the plan
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
        scheduler.step()
