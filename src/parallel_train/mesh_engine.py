"""The mesh engine: FSDP2, HSDP and tensor parallelism on a device mesh, with plain torch, on CPU and GPU alike.

Runs when parallel.dp_shard > 1 or parallel.tp > 1 (or under an FSDP launch config such as fsdp.yaml) without a
pipeline; with parallel.pipeline_stages > 1 the multi-process pipeline applies the same cuts to its stages.

Set-up, in order: the device mesh over every process (mesh.py: dp_replicate x dp_shard x pp x tp), the
model's tensor-parallel plan on the "tp" axis, `fully_shard` per block and on the root over the data-parallel
axes (sharding.py), then the optimizer pointed at the sharded parameters. Ranks of one tensor-parallel group
read the same batch; each data-parallel rank its own slice of the global batch. FSDP2 averages gradients over
the data-parallel ranks as DDP does, so with the same global batch the steps equal one process's.

Accelerate supplies the process group, the device and autocast only. `accelerator.prepare` cannot take a
`fully_shard` model on CPU (c10d.broadcast_ has no sharding strategy: platform-facts.md), and on GPUs
accelerate's own FSDP2 would wrap the model a second time; so the same code runs everywhere, gloo or NCCL.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.config import Config
from parallel_train.engine import RankState, allow_every_update
from parallel_train.eval_metrics import add_stats, add_totals, metric_stats, metric_values
from parallel_train.losses import loss_fn
from parallel_train.mesh import MeshLayout, build_device_mesh, mesh_summary, share_line
from parallel_train.sharding import clip_grad_norm, local_numel, parallelize, retarget_optimizer


class MeshEngine:
    """The Engine protocol (engine.py) over a sharded model; collectives run on every rank."""

    def __init__(self, cfg: Config, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, val_loader, layout: MeshLayout):
        self.cfg, self.accelerator, self.optimizer, self.val_loader, self.layout = cfg, accelerator, optimizer, val_loader, layout
        self.device = accelerator.device
        rank = accelerator.process_index
        self.dp_size, self.dp_rank = layout.dp, layout.dp_rank(rank)
        self.tp_rank = layout.coordinate(rank)["tp"]
        if cfg.train.compile:
            accelerator.print("notice: train.compile is not applied under the device mesh (FSDP2 / tensor parallel); training uncompiled")
        self._flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        total = sum(q.numel() for q in model.parameters())
        names = {id(q): n for n, q in model.named_parameters()}
        self.mesh = build_device_mesh(layout, self.device.type)
        parallelize(model, self.mesh, layout)  # moves each rank's slices to the mesh's device
        self.model = model.to(self.device)  # anything the plan left whole
        retarget_optimizer(optimizer, names, model)
        self.params = [q for group in optimizer.param_groups for q in group["params"]]
        self.local_numel = local_numel(model)
        self.update_allowed = allow_every_update  # the trainer installs guards.RunGuard.update_allowed
        what = [w for w, on in (("HSDP" if layout.dp_replicate > 1 else "FSDP2", layout.dp > 1), ("tensor parallel", layout.tp > 1)) if on]
        self.name = f"device mesh ({' + '.join(what)}, plain torch): {share_line(layout, self.local_numel, total)}"

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        A = self.cfg.train.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for _ in range(A):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.accelerator.autocast():
                loss = loss_fn(self.model(x), y)
            # FSDP2 reduce-scatters (averages over data-parallel ranks) after every backward; /A: the step's mean.
            (loss / A).backward()
            loss_sum += loss.detach()
            tokens += y.numel()
        max_norm = self.cfg.train.grad_clip or (math.inf if self.cfg.train.max_skipped_steps else 0)
        grad_norm = clip_grad_norm(self.params, max_norm) if max_norm else None
        if self.update_allowed(loss_sum / A, grad_norm):  # guards.py: False skips a non-finite step
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / A, tokens

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks (tensor-parallel ranks hold the same loss: a mean over all is the same)."""
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / self.accelerator.num_processes

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The fixed eval batches, taken in turn by the data-parallel ranks. Every forward is a collective
        (FSDP all-gathers, TP all-reduces), so every rank runs as many: a rank past the end repeats batch 0
        and counts nothing. Tensor-parallel ranks compute the same logits: only tp rank 0 contributes."""
        self.model.eval()
        batches = list(self.val_loader)
        rounds = math.ceil(len(batches) / self.dp_size)
        totals = None
        for k in range(rounds):
            i = k * self.dp_size + self.dp_rank
            x, y = batches[i] if i < len(batches) else batches[0]
            with self.accelerator.autocast():
                logits = self.model(x.to(self.device))
            if i < len(batches):
                totals = add_stats(totals, metric_stats(logits, y))
        self.model.train()
        parts: list[dict | None] = [None] * self.accelerator.num_processes
        mine = {k: v.cpu() for k, v in totals.items()} if totals is not None and self.tp_rank == 0 else None
        dist.all_gather_object(parts, mine)
        summed = None
        for part in filter(None, parts):
            summed = add_totals(summed, part)
        return metric_values(summed)

    def flops_per_token(self) -> int | None:
        return self._flops

    # ---- state: this rank's DTensor shards under canonical names; checkpoints write each once (any topology loads them)
    def rank_state(self) -> RankState:
        return RankState(self.model.state_dict(), self.model, self.optimizer)

    def finish(self, out: Path) -> dict[str, Any]:
        return mesh_summary(self.layout, self.local_numel)
