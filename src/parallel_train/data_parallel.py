"""The default engine: data parallelism. Accelerate places the model and wraps it in DDP (one process per
device); every rank runs the whole model on its shard of the global batch (batch_sampler.py), and DDP
averages the gradients. Under an FSDP or DeepSpeed accelerate config, the same code runs sharded.

`rank_state` hands checkpoints this rank's model and optimizer under canonical names (DTensor shards under FSDP2),
so checkpoints from any engine load into any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_train.config import Config
from parallel_train.engine import RankState, allow_every_update
from parallel_train.eval_metrics import add_stats, metric_stats, metric_values
from parallel_train.losses import loss_fn
from parallel_train.mesh import MeshLayout, mesh_summary, share_line
from parallel_train.named_state import torch_optimizer


class DataParallelEngine:
    name = "data parallel (DDP via Accelerate)"

    def __init__(self, cfg: Config, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, val_loader):
        self.cfg, self.accelerator = cfg, accelerator
        self.layout = MeshLayout(dp_replicate=accelerator.num_processes)  # every rank holds the whole model
        self.local_numel = sum(q.numel() for q in model.parameters())
        self.name = f"{self.name}: {share_line(self.layout, self.local_numel, self.local_numel)}"
        self.loss_fn = loss_fn
        if cfg.train.compile:
            # In place (nn.Module.compile): parameter names stay canonical for checkpoints; the loss is
            # compiled too, so the float cast and log-softmax over the vocabulary fuse into one kernel.
            model.compile()
            self.loss_fn = torch.compile(loss_fn)
        self.model, self.optimizer, self.val_loader = accelerator.prepare(model, optimizer, val_loader)
        self.device = accelerator.device
        self.update_allowed = allow_every_update  # the trainer installs guards.RunGuard.update_allowed
        # Data parallelism: which shard of the global batch this process reads (data.py).
        self.dp_size, self.dp_rank = accelerator.num_processes, accelerator.process_index

    @property
    def unwrapped(self) -> nn.Module:
        """The plain model, with canonical parameter names."""
        return self.accelerator.unwrap_model(self.model)

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, int]:
        """One optimizer step over gradient_accumulation_steps micro-batches.

        Returns (mean loss of this rank's micro-batches as a device tensor, tokens this rank saw);
        no host-device sync here: the trainer reads the loss only on log steps.
        """
        accelerator, A = self.accelerator, self.cfg.train.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for _ in range(A):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            # accumulate(): no DDP all-reduce until the last micro-step; backward() divides by A.
            with accelerator.accumulate(self.model):
                loss = self.loss_fn(self.model(x), y)
                accelerator.backward(loss)
            loss_sum += loss.detach()
            tokens += y.numel()
        # The norm is needed for clipping, and to skip non-finite steps (inf: measure without clipping).
        max_norm = self.cfg.train.grad_clip or (math.inf if self.cfg.train.max_skipped_steps else 0)
        grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), max_norm) if max_norm else None
        if self.update_allowed(loss_sum / A, grad_norm):  # guards.py: False skips a non-finite step
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / A, tokens

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation metrics (eval_metrics.py; "loss" first) over the fixed eval set, each sample counted once
        across ranks."""
        self.model.eval()
        totals = None
        for x, y in self.val_loader:
            totals = add_stats(totals, self.accelerator.gather_for_metrics(metric_stats(self.model(x), y)))
        self.model.train()
        return metric_values(totals)

    def rank_state(self) -> RankState:
        """The plain model and the torch optimizer (DTensor shards under FSDP2); no copy, no communication."""
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # ZeRO keeps the optimizer state in flat partitions without parameter names (not saved; the run says so
            # at start), and ZeRO-3 partitions the weights too: accelerate gathers them (a collective there).
            return RankState(self.accelerator.get_state_dict(self.model) or {}, self.unwrapped, None)
        return RankState(self.unwrapped.state_dict(), self.unwrapped, torch_optimizer(self.optimizer))

    def flops_per_token(self) -> int | None:
        return self.unwrapped.flops_per_token() if hasattr(self.unwrapped, "flops_per_token") else None

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged over data-parallel ranks, for logging. A collective."""
        return self.accelerator.reduce(loss, reduction="mean")

    def finish(self, out: Path) -> dict[str, Any]:
        """End-of-run extras for summary.json: the mesh and what rank 0 holds (pipeline engines add their timeline)."""
        return mesh_summary(self.layout, self.local_numel)
