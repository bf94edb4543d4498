"""The mesh engine: FSDP2, HSDP and tensor parallelism on a device mesh, with plain torch, on CPU and GPU alike.

Runs when parallel.dp_shard > 1 or parallel.tp > 1 (or under an FSDP launch config such as fsdp.yaml) without a
pipeline; with parallel.pipeline_stages > 1 the multi-process pipeline applies the same cuts to its stages.

Set-up, in order: the device mesh over every process (parallel/mesh.py: dp_replicate x dp_shard x pp x tp), the
model's tensor-parallel plan on the "tp" axis, torch.compile per block (train.compile), `fully_shard` per block
and on the root over the data-parallel axes with the run's precision policy (parallel/sharding.py, parallel/precision.py;
under bf16/fp16 also with tensor parallelism alone, over one data-parallel rank: the layers compute in bf16), then
the optimizer over the sharded parameters. Ranks of one tensor-parallel group read the same batch; each
data-parallel rank its own slice of the global batch. FSDP2 averages gradients over the data-parallel ranks as
DDP does, so with the same global batch the steps equal one process's (step.py).

Gradient accumulation: FSDP2 reduce-scatters gradients once per optimizer step, after the last micro-step's
backward (`set_requires_gradient_sync`); until then each rank keeps the unsharded gradients of the blocks it
ran, which costs the memory of one whole set of gradients (in the reduce dtype). `parallel.reduce_every_microstep
=true` reduce-scatters after every micro-step instead: sharded gradients only, but A times the communication.

Accelerate supplies the process group, the device and autocast only. `accelerator.prepare` cannot take a
`fully_shard` model on CPU (c10d.broadcast_ has no sharding strategy: platform-facts.md), and on GPUs
accelerate's own FSDP2 would wrap the model a second time; so the same code runs everywhere, gloo or NCCL.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_train.checkpoint.named_state import RankState
from parallel_train.config.sections import Config
from parallel_train.losses import cross_entropy_sum
from parallel_train.models.ties import find_ties
from parallel_train.parallel.context_parallel import on_mesh
from parallel_train.parallel.ddp_engine import OptimizerFactory
from parallel_train.parallel.engine import accumulate
from parallel_train.parallel.mesh import MeshLayout, build_device_mesh, mesh_summary, share_line
from parallel_train.parallel.precision import Precision
from parallel_train.parallel.router_balance import router_balance
from parallel_train.parallel.sharding import (
    clip_grad_norm,
    cuts_line,
    gathered_logits_notice,
    local_numel,
    loss_context,
    parallelize,
    refuse_cut_ties,
    tensor_parallel_cuts,
)
from parallel_train.tasks.registry import task_of


class MeshEngine:
    """The Engine protocol (parallel/engine.py) over a sharded model; collectives run on every rank."""

    def __init__(
        self, cfg: Config, accelerator, model: nn.Module, init, make_optimizer: OptimizerFactory, precision: Precision, layout: MeshLayout
    ):
        self.cfg, self.accelerator, self.precision, self.layout = cfg, accelerator, precision, layout
        self.device = accelerator.device
        rank = accelerator.process_index
        self.dp_size, self.dp_rank = layout.dp, layout.dp_rank(rank)
        self.tp_rank = layout.coordinate(rank)["tp"]
        self.loss_owner = self.tp_rank == 0  # tensor-parallel peers compute the same loss
        self._flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        total = sum(q.numel() for q in model.parameters())
        self.ties = find_ties(model)  # one tensor under FSDP2 (one root group holds it); tensor parallelism would cut it apart
        refuse_cut_ties(model, self.ties, layout.tp)
        # Loss parallel under tensor parallelism: the logits stay cut by vocabulary and plain cross-entropy runs on the
        # shards; another loss gets them gathered whole. Decided (and a length sequence parallel cannot cut refused)
        # alike on every rank, before the mesh's first collective.
        loss_sum = task_of(cfg).loss_sum  # the task's loss (tasks/)
        sequence_parallel, self.loss_parallel = tensor_parallel_cuts(model, layout.tp, cfg.model.block_size, loss_sum)
        self.notice = gathered_logits_notice(model, layout.tp, self.loss_parallel, cfg.train.batch_size, cfg.model.block_size // layout.cp)
        self.mesh = build_device_mesh(layout, self.device.type)
        self.cp = on_mesh(self.mesh, layout, rank, [model])  # parallel.cp > 1: the model takes this rank's part of each sequence
        policy = precision.fsdp_policy()
        self.compiled = parallelize(model, self.mesh, layout, mp_policy=policy, compile=cfg.train.compile, loss_parallel=self.loss_parallel)
        init.fill(model, self.device)  # parallel/model_init.py: only now does this rank's slice of each parameter get memory
        self.model = model
        self.balance = router_balance(model, cfg, self.dp_size, self.device)  # MoE layers: their balancing loss
        self.fsdp = hasattr(model, "set_requires_gradient_sync")  # fully_shard made it an FSDPModule
        self.autocast = not (self.fsdp and policy is not None)  # FSDP2's policy already computes in bf16/fp16
        if self.loss_parallel:  # plain cross-entropy (losses.plain_cross_entropy), computed on DTensor shards
            self.loss_fn = cross_entropy_sum
        else:
            self.loss_fn = torch.compile(loss_sum) if cfg.train.compile else loss_sum
        self.optimizer = make_optimizer(model)
        self.params = [q for group in self.optimizer.param_groups for q in group["params"]]
        self.local_numel = local_numel(model)
        what = [("HSDP" if layout.dp_replicate > 1 else "FSDP2", layout.dp > 1 or layout.cp > 1), ("tensor parallel", layout.tp > 1)]
        what = [w for w, on in what + [(f"context parallel over {layout.cp} ranks (Ulysses all-to-all attention)", layout.cp > 1)] if on]
        self.name = f"device mesh ({' + '.join(what)}, plain torch): {share_line(layout, self.local_numel, total)}"
        self.name += cuts_line(sequence_parallel, self.loss_parallel)
        if self.fsdp and policy is not None:
            self.name += f"; FSDP2 mixed precision: parameters gathered and computed in {precision.name}, gradients reduced in fp32"
            if layout.dp == layout.cp == 1:  # tensor parallel alone: FSDP2 over one rank, for its policy only (sharding.fsdp_wraps)
                self.name += " (over one data-parallel rank: fp32 master weights, nothing gathered)"

    def _sync(self, last: bool):
        """FSDP2 reduce-scatters after the last micro-step only (unless parallel.reduce_every_microstep)."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last or self.cfg.parallel.reduce_every_microstep)
        return nullcontext()

    def forward_backward(self, micro, scale: torch.Tensor, precision: Precision) -> torch.Tensor:
        def forward(x: torch.Tensor, **kwargs) -> torch.Tensor:  # kwargs: a packed batch's positions (data/batch.py)
            with precision.autocast(self.autocast):
                return self.model(x, **kwargs)

        with loss_context(self.loss_parallel):  # forward, loss and backward: loss_parallel's ops run in all three
            extra = self.balance.extra(len(micro), scale) if self.balance else None
            if self.cp is not None:  # each rank its part of every sequence; FSDP2's average over the cp ranks made a sum
                micro, scale = [self.cp.cut_batch(b) for b in micro], scale * self.cp.size
            backward = lambda s: precision.scale(s * scale).backward()  # noqa: E731
            return accumulate(micro, forward, self.loss_fn, backward, self._sync, self.device, extra)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.params, max_norm)

    def eval_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """Every rank runs the forward (FSDP all-gathers, TP all-reduces); tensor-parallel rank 0 reports. Under loss
        parallel every tensor-parallel rank gets its slice of the logits, cut by vocabulary: the metrics run on the
        slices, never gathering the whole (parallel/vocab_metrics.py)."""
        if self.cp is not None:  # each rank its part of the sequence, the logits gathered whole on the group's first
            x = self.cp.cut(x)
        with self.precision.autocast(self.autocast):
            logits = self.model(x.to(self.device), **{k: v.to(self.device) for k, v in kwargs.items()})
        if self.cp is not None:  # under loss parallel each tp rank's vocabulary slice, gathered over its cp group
            logits = self.cp.gather(logits)
            if self.cp.rank:
                return None
        return logits if self.tp_rank == 0 or self.loss_parallel else None

    def set_training(self, on: bool) -> None:
        self.model.train(on)

    def flops_per_token(self) -> int | None:
        return self._flops

    # ---- state: this rank's DTensor shards under canonical names; checkpoints write each once (any topology loads them)
    def rank_state(self) -> RankState:
        return RankState(self.model.state_dict(), self.model, self.optimizer, self.ties)

    def finish(self, out: Path) -> dict[str, Any]:
        return mesh_summary(self.layout, self.local_numel)
