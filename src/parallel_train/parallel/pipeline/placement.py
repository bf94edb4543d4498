"""Which pipeline rank holds which stage, and a forward pass through the stages wherever they are (evaluation).

Placements (S pipeline ranks, V stages each, S x V stages of the model in forward order):
- one stage per rank (gpipe, 1f1b): rank k holds stage k;
- looped (interleaved1f1b, interleavedzb): rank k holds stages k, k+S, k+2S, ...;
- V-shaped (zbv, dualpipev; V = 2): rank k holds stages k and 2S-1-k, so rank 0 holds the first and the last
  stage and the activations turn around on rank S-1 without a hop. torch's V schedules expect exactly this.

Evaluation runs forward only. torch's zero-bubble schedules cannot (ZBV's `eval` asserts that a stage has no
backward; DualPipeV's fails mid-way; torch 2.13, measured), so evaluation sends each stage's output to the
next stage's rank itself: a shape header, then the tensor, point to point over the pipeline group. One batch
at a time; evaluation does not need the overlap a schedule buys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOOPED = ("interleaved1f1b", "interleavedzb")
V_SHAPED = ("zbv", "dualpipev")


def stages_per_rank(schedule: str, requested: int) -> int:
    return 2 if schedule in V_SHAPED else requested if schedule in LOOPED else 1


def stages_of_rank(rank: int, n_ranks: int, per_rank: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `rank` holds, in forward order."""
    if schedule in V_SHAPED:
        return [rank, 2 * n_ranks - 1 - rank]
    return [rank + k * n_ranks for k in range(per_rank)]


def rank_of_stage(n_ranks: int, per_rank: int, schedule: str) -> dict[int, int]:
    return {s: r for r in range(n_ranks) for s in stages_of_rank(r, n_ranks, per_rank, schedule)}


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def _send(t: torch.Tensor, dst: int, group) -> None:
    header = torch.tensor([DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64)
    dist.send(torch.cat([header, torch.zeros(8 - len(header), dtype=torch.int64)]).to(t.device), group_dst=dst, group=group)
    dist.send(t.contiguous(), group_dst=dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, group_src=src, group=group)
    dtype, ndim, *shape = header.tolist()
    t = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
    dist.recv(t, group_src=src, group=group)
    return t


def forward_through(
    stages: dict[int, torch.nn.Module], where: dict[int, int], my_rank: int, x, group, device, kwargs: dict | None = None
) -> torch.Tensor | None:
    """The model's output for input `x` (used on the rank of stage 0), returned on the rank of the last stage
    (None elsewhere). `stages`: this rank's stage modules by index; `where`: stage index -> pipeline rank;
    `kwargs` (a packed batch's positions, which every rank reads) go to every stage."""
    h = x.to(device) if 0 in stages else None
    kwargs = {k: v.to(device) for k, v in (kwargs or {}).items()}
    for s in range(len(where)):
        if s > 0 and where[s - 1] != where[s]:
            if my_rank == where[s - 1]:
                _send(h, where[s], group)
            elif my_rank == where[s]:
                h = _recv(where[s - 1], group, device)
        if s in stages:
            h = stages[s](h, **kwargs)
    return h if len(where) - 1 in stages else None
