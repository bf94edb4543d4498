"""Small agreements between ranks: every rank's value, or rank 0's decision, on every rank.

Decisions that only one rank can make (rank 0 lists checkpoints/, takes output_dir's lock) are made there and
handed to every rank, errors included, so every rank goes the same way and none waits for a peer that left.
Values are small and our own (lists of names, one-line messages): they travel pickled, as torch's object
collectives do. Without a process group (one process) the value is returned as it is.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


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
