"""The default engine: data parallelism. Accelerate places the model and wraps it in DDP (one process per
device); every rank runs the whole model on its shard of the global batch (data/batch_sampler.py), and DDP
averages the gradients once per optimizer step. Under a DeepSpeed accelerate config, the same code runs ZeRO.

The optimizer step itself (count, scale, clip, guard, update) is step.py's, the same for every engine; this file
says only how a DDP model runs its micro-batches. `rank_state` hands checkpoints the model and optimizer under
canonical names, so checkpoints from any engine load into any other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_train.checkpoint.named_state import RankState, torch_optimizer
from parallel_train.config.sections import Config
from parallel_train.models.ties import find_ties
from parallel_train.parallel.engine import accumulate
from parallel_train.parallel.mesh import MeshLayout, mesh_summary, share_line
from parallel_train.parallel.precision import Precision
from parallel_train.parallel.router_balance import router_balance
from parallel_train.tasks.registry import task_of

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


class DataParallelEngine:
    name = "data parallel (DDP via Accelerate)"

    def __init__(
        self,
        cfg: Config,
        accelerator,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        precision: Precision,
        init=None,
        device_placement: bool = True,
        compile: bool | None = None,
    ):
        self.cfg, self.accelerator, self.precision = cfg, accelerator, precision
        if init is not None:  # parallel/model_init.py: the whole model's first weights, on this process's device
            init.fill(model, accelerator.device)
        self.layout = MeshLayout(dp_replicate=accelerator.num_processes)  # every rank holds the whole model
        self.local_numel = sum(q.numel() for q in model.parameters())
        self.name = f"{self.name}: {share_line(self.layout, self.local_numel, self.local_numel)}"
        loss_sum = task_of(cfg).loss_sum  # the task's loss (tasks/): cross-entropy of the logits against the labels
        self.loss_fn = loss_sum
        self.compiled = ""
        if cfg.train.compile if compile is None else compile:
            # In place (nn.Module.compile): parameter names stay canonical for checkpoints; the loss is
            # compiled too, so the float cast and log-softmax over the vocabulary fuse into one kernel.
            model.compile()
            self.loss_fn = torch.compile(loss_sum)
            self.compiled = "the whole model and the loss (torch.compile)"
        # One prepare call for both: DeepSpeed builds its engine from the model and the optimizer together.
        placement = [device_placement, device_placement]
        self.model, self.optimizer = accelerator.prepare(model, make_optimizer(model), device_placement=placement)
        self.ties = find_ties(self.unwrapped)  # tied weights are one tensor here: checkpoints store them once (models/ties.py)
        self.device = accelerator.device
        # Data parallelism: which shard of the global batch this process reads (data/batch_sampler.py).
        self.dp_size, self.dp_rank = accelerator.num_processes, accelerator.process_index
        self.loss_owner = True  # every replica computes its own shard's loss
        self.balance = router_balance(self.unwrapped, cfg, self.dp_size, self.device)  # MoE layers: their balancing loss

    @property
    def unwrapped(self) -> nn.Module:
        """The plain model, with canonical parameter names."""
        return self.accelerator.unwrap_model(self.model)

    def forward_backward(self, micro, scale: torch.Tensor, precision: Precision) -> torch.Tensor:
        accelerator, A = self.accelerator, len(micro)

        def forward(x: torch.Tensor, **kwargs) -> torch.Tensor:  # kwargs: a packed batch's positions (data/batch.py)
            with precision.autocast():
                return self.model(x, **kwargs)

        def backward(s: torch.Tensor) -> None:
            # accelerate's backward divides by gradient_accumulation_steps (a mean over micro-steps); `scale`
            # already divides by the whole step's token count, so multiply that division away.
            accelerator.backward(precision.scale(s * scale) * A)

        # accumulate(): no DDP all-reduce until the last micro-step (and DeepSpeed's accumulation boundary).
        extra = self.balance.extra(A, scale) if self.balance else None
        return accumulate(micro, forward, self.loss_fn, backward, lambda last: accelerator.accumulate(self.model), self.device, extra)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def eval_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        with self.precision.autocast():
            return self.model(x.to(self.device), **{k: v.to(self.device) for k, v in kwargs.items()})

    def set_training(self, on: bool) -> None:
        self.model.train(on)

    def rank_state(self) -> RankState:
        """The plain model and the torch optimizer; no copy, no communication."""
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # ZeRO keeps the optimizer state in flat partitions without parameter names (not saved; the run says so
            # at start), and ZeRO-3 partitions the weights too: accelerate gathers them (a collective there).
            return RankState(self.accelerator.get_state_dict(self.model) or {}, self.unwrapped, None, self.ties)
        return RankState(self.unwrapped.state_dict(), self.unwrapped, torch_optimizer(self.optimizer), self.ties)

    def flops_per_token(self) -> int | None:
        return self.unwrapped.flops_per_token() if hasattr(self.unwrapped, "flops_per_token") else None

    def finish(self, out: Path) -> dict[str, Any]:
        """End-of-run extras for summary.json: the mesh and what rank 0 holds (pipeline engines add their timeline)."""
        return mesh_summary(self.layout, self.local_numel)
