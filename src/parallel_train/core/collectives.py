"""Small agreements between ranks, the one home of the template's collective helpers: every rank's value, rank 0's
decision, a few summed numbers.

This module sits below everything else (it imports only torch): data, checkpoints and the run's folder use it as
much as the engines do.

Decisions that only one rank can make (rank 0 lists checkpoints/, takes output_dir's lock) are made there and
handed to every rank, errors included, so every rank goes the same way and none waits for a peer that left.
Values are small and our own (lists of names, one-line messages): they travel pickled, as torch's object
collectives do. Without a process group (one process) the value is returned as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj` on every rank (a collective over `group`); [obj] without a process group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank0(obj: Any, group=None) -> Any:
    """Rank 0's `obj` on every rank (a collective; the other ranks' values are ignored)."""
    return all_gather(obj, group)[0]


def gather_to_rank0(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj` on rank 0 (a collective; [] on the others, [obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    parts = [None] * dist.get_world_size(group) if rank() == 0 else None
    dist.gather_object(obj, parts, dst=0, group=group)
    return parts or []


def all_reduce_small(t: torch.Tensor, op, device: torch.device | str, group=None) -> torch.Tensor:
    """All-reduce a few numbers across ranks (of `group`: all by default; nothing to do in one process): on `device`
    under NCCL (which cannot reduce CPU tensors), on the CPU under gloo."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        where = torch.device(device if dist.get_backend() == "nccl" else "cpu")
        if t.device != where:  # a copy, and on a GPU a sync: the callers that run every step make t there already
            t = t.to(where)
        dist.all_reduce(t, op=op, group=group)
    return t
