"""Sharded tensors (FSDP2's DTensor) <-> whole tensors, so checkpoints hold full tensors with canonical names.

Under FSDP2 (`fully_shard`, what accelerate_configs/fsdp.yaml runs) every parameter, and the optimizer state of
every parameter, is a DTensor: each rank holds one slice. This template's checkpoints are topology-free (a run on
any number of processes loads them), so saving gathers each DTensor into the whole tensor, and loading cuts a
whole tensor back into this rank's slice. On plain tensors (DDP, one process, pipeline stages) both are no-ops.

`to_full` on a DTensor is a collective (an all-gather): every rank must call it for the same tensors, in the
same order. `shard_like` needs no communication: every rank read the whole tensor from the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
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


def gather_full_state(module: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """`module`'s state as whole tensors on the CPU, kept only where `keep` ({} elsewhere). A collective over
    the meshes of its DTensors (FSDP2, tensor parallel): every rank of those meshes calls it, in the same order."""
    out = {}
    for key, value in module.state_dict().items():
        full = to_full(value)  # one tensor at a time: host memory holds one whole tensor beyond the state
        if keep:
            out[key] = full.detach().contiguous().cpu()
    return out


def upgrade_names(model: nn.Module, state: dict) -> dict:
    """Keys of checkpoints written before a model renamed its parameters, converted by the model's own
    `upgrade_state_dict` (models/gpt.py: the fused qkv), if it has one."""
    upgrade = getattr(model, "upgrade_state_dict", None)
    return upgrade(state) if upgrade is not None else state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(state)` for whole tensors, also when `model`'s parameters are sharded DTensors."""
    state = upgrade_names(model, state)
    current = model.state_dict()
    model.load_state_dict({k: shard_like(v, current[k]) if k in current else v for k, v in state.items()})
