"""Test helpers: sharded tensors (FSDP2's and tensor parallelism's DTensor) <-> whole tensors.

Under FSDP2 (`fully_shard`, what accelerate_configs/fsdp.yaml runs) every parameter, and the optimizer state of
every parameter, is a DTensor: each rank holds one slice. Checkpoints store those slices as they are (each rank
its own, checkpoint/storage.py); whole tensors appear only where a whole tensor is read: a checkpoint written
before sharded saves (every rank reads it whole and keeps its slice: `shard_like`), and tests (`to_full`).
On plain tensors (DDP, one process, pipeline stages) both are no-ops.

`to_full` on a DTensor is a collective (an all-gather): every rank must call it for the same tensors, in the
same order. `shard_like` needs no communication: every rank read the whole tensor from the checkpoint.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(t: object) -> bool:
    return isinstance(t, DTensor)


def to_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a plain tensor (all-gathered over the mesh if `t` is a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` cut the way `like` is cut (this rank's slice, as a DTensor); `full` itself if `like` is plain.

    Keeps `full`'s dtype (optimizer state may differ from the parameter's) and moves it to `like`'s device.
    """
    if not isinstance(like, DTensor) or full.shape != like.shape:
        return full  # plain parameters, and per-parameter scalars such as Adam's `step`
    # src_data_rank=None: every rank already holds the whole tensor, so each keeps its slice, no broadcast.
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
