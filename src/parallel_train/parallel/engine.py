"""The Engine: how this topology runs a model. The trainer talks to nothing else.

What every engine has in common is written once: the optimizer step (step.py: micro-batches, the step's count
of valid tokens, unscale, clip, guard, update) and evaluation (evaluation.py). An engine supplies only what
differs between topologies: how the micro-batches of one step go forward and backward and how their gradients
are synchronised (`forward_backward`), where its gradients live for the global norm (`clip_grad_norm`), and
its forward for evaluation (`eval_forward`).

Engines: `DataParallelEngine` (parallel/ddp_engine.py; DDP, or DeepSpeed through accelerate), `MeshEngine`
(parallel/mesh_engine.py; FSDP2, HSDP and tensor parallel on a device mesh), and the pipeline engines
(parallel/pipeline/inprocess.py: stages on several devices in one process; parallel/pipeline/distributed.py: one stage per
process, on the mesh). parallel/build.py picks one for a config. Every engine owns the model and the optimizer, and every
method marked "a collective" must be called by every rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from parallel_train.checkpoint.named_state import RankState
from parallel_train.data.batch import Batch, parts
from parallel_train.losses import logits_of


class Engine(Protocol):
    name: str  # one line for the start banner: what the processes do
    accelerator: Any  # accelerate.Accelerator (imported lazily: it costs seconds)
    optimizer: torch.optim.Optimizer  # holds exactly this rank's parameters (whole model, shard or stage)
    device: torch.device  # where targets meet the logits
    dp_size: int  # data-parallel replicas: each global batch is cut into this many shards
    dp_rank: int  # the shard this process reads
    loss_owner: bool  # this rank's loss counts in the logged loss (not a tensor-parallel copy, nor a non-last stage)

    def forward_backward(self, micro: list[tuple[torch.Tensor, ...]], scale: torch.Tensor, precision) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one optimizer step, each micro-batch's summed token
        loss multiplied by `scale` (and the fp16 loss scale, `precision.scale`) before backward, gradients
        synchronised over the data-parallel ranks once. Returns this rank's summed token loss (a device tensor:
        no host sync). A collective."""
        ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of the whole model (every rank's part) to max_norm; returns the global norm, the same
        on every rank. A collective."""
        ...

    def eval_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """Logits for inputs `x` (kwargs: a packed batch's positions, data/batch.py) where this rank reports them, None
        elsewhere; logits cut by vocabulary (loss parallel) on every tensor-parallel rank of the holder, each its slice
        (evaluation.py counts `loss_owner`'s). A collective on sharded models."""
        ...

    def set_training(self, on: bool) -> None:
        """Training mode (dropout on) or evaluation mode, for every part this rank holds."""
        ...

    def flops_per_token(self) -> int | None:
        """Training FLOPs per token of the whole model, for MFU (None: unknown)."""
        ...

    def rank_state(self) -> RankState:
        """This rank's model and optimizer state by canonical name (see RankState). No communication, except under
        DeepSpeed ZeRO, where accelerate gathers the weights (a collective there)."""
        ...

    def finish(self, out: Path) -> dict[str, Any]:
        """End-of-run extras for summary.json (pipeline engines draw their timeline). A collective."""
        ...


def accumulate(
    micro: list[Batch],
    forward: Callable[..., torch.Tensor],
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    sync: Callable[[bool], AbstractContextManager],
    device: torch.device,
    extra: Callable[[], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn, `sync(last)` around each so that gradients are
    synchronised on the last one only (DDP's no_sync, FSDP2's set_requires_gradient_sync). Returns the summed
    token loss (a device tensor: no host sync). Used by the engines whose model runs micro-batches one at a time.
    `forward(inputs, **kwargs)`: kwargs are the batch's other inputs (a dict batch's attention_mask, a packed batch's
    positions: data/batch.py). `extra()`, called after each forward: a term added to what goes backward (the router's
    balancing loss, parallel/router_balance.py), not to the returned loss; None adds nothing."""
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro):
        x, y, kwargs = parts(batch, device)
        with sync(i == len(micro) - 1):
            s = loss_sum(logits_of(forward(x, **kwargs)), y)  # a ModelOutput or a dict: its logits
            term = extra() if extra is not None else None
            backward(s if term is None else s + like(s, term))
        total += s.detach().full_tensor() if hasattr(s, "full_tensor") else s.detach()  # loss parallel's is a DTensor
    return total


def like(s: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """`term` as a DTensor replicated on the mesh of `s` where `s` is one (loss parallel's loss), so that the two add."""
    if not hasattr(s, "device_mesh"):
        return term
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(term, s.device_mesh, [Replicate()] * s.device_mesh.ndim)
