"""The Engine: how one optimizer step runs on this topology. The trainer talks to nothing else.

Engines: `DataParallelEngine` (data_parallel.py; DDP, or DeepSpeed through accelerate), `MeshEngine`
(mesh_engine.py; FSDP2, HSDP and tensor parallel on a device mesh), and the pipeline engines
(pipeline/inprocess.py: stages on several devices in one process; pipeline/distributed.py: one stage per
process, on the mesh). topology.py picks one for a config. Every engine owns the model and the optimizer, and every
method marked "a collective" must be called by every rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

# (mean loss of the step, global gradient norm or None) -> may the optimizer apply this step's update?
UpdateGate = Callable[[torch.Tensor, torch.Tensor | None], bool]


def allow_every_update(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
    """The default gate, until the trainer installs guards.RunGuard.update_allowed (which skips non-finite steps)."""
    return True


@dataclass
class RankState:
    """This rank's part of the training state, under canonical parameter names: what checkpoints write and read.

    Whole tensors (one process, DDP), DTensor shards (FSDP2, tensor parallel) or a pipeline rank's own stages; no
    copy and no communication. checkpoint.py writes each rank's part once (replicated tensors by one rank only) and
    loads any checkpoint into any RankState by name, so checkpoints move between topologies.
    """

    model: dict[str, torch.Tensor]  # weights and buffers by canonical name (module.state_dict())
    module: nn.Module  # holds this rank's parameters under canonical names (named_parameters, load_state_dict)
    # the torch optimizer over exactly those parameters; None where its state has no per-parameter form (DeepSpeed ZeRO)
    optimizer: torch.optim.Optimizer | None


class Engine(Protocol):
    name: str  # one line for the start banner: what the processes do
    accelerator: Any  # accelerate.Accelerator (imported lazily: it costs seconds)
    optimizer: torch.optim.Optimizer  # holds exactly this rank's parameters (whole model, shard or stage)
    device: torch.device  # where targets meet the logits
    model: nn.Module | None  # what forward runs through in this process; None when split over stage views
    dp_size: int  # data-parallel replicas: each global batch is cut into this many shards
    dp_rank: int  # the shard this process reads
    update_allowed: UpdateGate

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, int]:
        """One optimizer step over gradient_accumulation_steps micro-batches: (this rank's mean loss as a device
        tensor, tokens this rank saw). No host-device sync: the trainer reads the loss on log steps only."""
        ...

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged over data-parallel ranks, for logging. A collective."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Every validation metric (eval_metrics.py; "loss" first) over the fixed eval set, each sample counted
        once across ranks. A collective."""
        ...

    def flops_per_token(self) -> int | None:
        """Training FLOPs per token of the whole model, for MFU (None: unknown)."""
        ...

    def rank_state(self) -> RankState:
        """This rank's model and optimizer state by canonical name (see RankState). No communication, except under
        DeepSpeed ZeRO-3, where accelerate gathers the weights (a collective there)."""
        ...

    def finish(self, out: Path) -> dict[str, Any]:
        """End-of-run extras for summary.json (pipeline engines draw their timeline). A collective."""
        ...
