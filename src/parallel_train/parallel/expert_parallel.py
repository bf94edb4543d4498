"""Expert parallelism (`parallel.ep=N`): the GPT's experts (models/moe.py) split over N data-parallel ranks, tokens
sent to the rank that holds their expert by all-to-all, and back.

The EP ranks come out of the FSDP2 ranks (as in torchtitan and transformers' `efsdp`): parallel.dp_shard = N x edp, the
"dp_shard" axis unflattened into ("ep", "edp"). EP rank r holds experts [r*E/N, (r+1)*E/N); the edp ranks that EP
leaves shard those further by their second dim (FSDP of the experts: gathered for the forward, gradients
reduce-scattered in its backward). Dense parameters (attention, router, embeddings, norms) stay FSDP2-sharded over all
dp_shard ranks as without EP.

With the other axes: under HSDP the grid is ("dp_replicate", "ep", "edp"), each replica holding every expert (Replicate
over the replicas, whose gradients are all-reduced); under tensor parallel each MoE layer runs whole on every tp rank
(models/gpt.py moe_plan), the EP group the dp_shard ranks at its tp coordinate; in pipeline stages each stage's experts
over its own dp_shard ranks (its balancing loss: parallel/pipeline/balance.py).

Each expert weight is a DTensor (Shard(0) over "ep", Shard(1) over "edp") that FSDP2 is told to leave alone
(`ignored_params`): checkpoints save it under its canonical name in parts, as FSDP2's own shards, so a run under ep=2
resumes on one process and the other way round (checkpoint/named_state.py).

One MoE layer's forward under EP (`ExpertExchange`), between models/moe.py's dispatch and combine:

    counts   each rank's per-expert row counts, exchanged (all_to_all_single of E integers): what each rank will get
    tokens   the rows, sorted by expert, sent to the ranks holding those experts (torch's differentiable all_to_all_single_autograd)
    compute  this rank's experts over the rows it got, regrouped by local expert
    back     the outputs sent back in the order they came (the same all-to-all, sizes swapped)

Gradients: the backward of the all-to-all carries each token's gradient back to its rank, and the expert weights'
gradients sum every rank's tokens. The engines scale each rank's loss by dp_size (FSDP2 averages the dense gradients
over the ranks, step.py), so the expert gradients, summed over the ep ranks by the all-to-all, over the edp ranks by
the reduce-scatter (and over HSDP's replicas), are divided by dp_size on the way (`scale_grad`): the same as one process.
The balancing loss (router_balance.py) is unchanged: each rank counts its own tokens per global expert, all-reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.errors import UserError
from parallel_train.models.moe import MoE

EXPERT_WEIGHTS = ("fc", "fc_bias", "proj", "proj_bias", "gate")  # models/moe.py compute's order; gate: the llama flavor's


def check_expert_layout(ep: int, dp_shard: int) -> None:
    """One line where the EP ranks are not a factor of the FSDP2 ranks (every rank decides alike, before any collective)."""
    if ep > 1 and dp_shard % ep:
        raise UserError(
            f"parallel.ep={ep} with parallel.dp_shard={dp_shard}: expert parallelism runs over the FSDP2 ranks (of each "
            f"replica); set parallel.dp_shard to a multiple of {ep} (or leave it at 1: ep fills what the other axes leave)"
        )


class GradScale(torch.autograd.Function):
    """The identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(t: torch.Tensor | None, factor: float) -> torch.Tensor | None:
    return None if t is None else GradScale.apply(t, factor)


class ExpertExchange:
    """A MoE layer's token exchange over the EP group (see the module docstring); `moe.exchange` calls it."""

    def __init__(self, group, ep: int, dp: int):
        self.group, self.ep, self.dp = group, ep, dp

    @torch.compiler.disable  # train.compile: the block compiled around it; the split sizes are read on the host anyway
    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all

        got_counts, send, recv, expert_of = split_sizes(counts, self.ep, self.group)
        got = all_to_all(rows, recv, send, self.group)  # differentiable: the backward sends the gradients back
        # Rows arrive by source rank, each rank's sorted by my experts: regroup them by expert (stable: sources in order).
        order = torch.argsort(expert_of, stable=True)
        weights = [scale_grad(local_tensor(getattr(moe, n), rows.dtype), 1.0 / self.dp) for n in EXPERT_WEIGHTS]
        out = moe.compute(got[order], got_counts.view(self.ep, -1).sum(dim=0), weights)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        return all_to_all(out[back], send, recv, self.group)


def split_sizes(counts: torch.Tensor, ep: int, group) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """Each rank's per-expert row counts (E,) exchanged over the ep group: the counts received ([source rank, my expert],
    flat), the rows sent to each rank and received from each (host reads: the all-to-all's split sizes), and the local
    expert of each received row, in arrival order. Shared by the GPT's exchange and a Hub MoE's (hf_expert_parallel.py)."""
    local = len(counts) // ep
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(ep, local).sum(dim=1).tolist()
    recv = got.view(ep, local).sum(dim=1).tolist()
    return got, send, recv, torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(got)


def local_tensor(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's experts whole, in the rows' dtype (FSDP2's bf16 policy casts the dense layers only): gathered over
    the "edp" ranks, whose backward reduce-scatters (sums) their gradients, and all-reduces them over the HSDP replicas
    (`grad_placements`: each rank's differ)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if t is None:
        return None
    lead = [Replicate()] * (t.device_mesh.ndim - 2)  # HSDP: the replicas' axis, in front of ("ep", "edp")
    whole = t.redistribute(t.device_mesh, [*lead, Shard(0), Replicate()])
    return whole.to_local(grad_placements=[Partial()] * len(lead) + [Shard(0), Partial()]).to(dtype)


def shard_experts(model: nn.Module, mesh, ep: int) -> set[nn.Parameter]:
    """Each MoE layer's expert weights as DTensors sharded by expert over `mesh` (the data-parallel mesh: "dp_shard",
    or ("dp_replicate", "dp_shard") under HSDP, whose replicas each hold every expert), its token exchange set; returns
    those parameters, for FSDP2 to ignore. On the meta device (model_init.py fills this rank's experts later)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if ep == 1 or not layers:
        return set()
    shard = mesh.size(mesh.ndim - 1)
    # dp_shard rank = ep rank x edp + edp rank, within each replica
    grid = mesh._unflatten(mesh.ndim - 1, (ep, shard // ep), ("ep", "edp"))
    exchange, held = ExpertExchange(grid["ep"].get_group(), ep, mesh.size()), set()
    for m in layers:
        for name in EXPERT_WEIGHTS:
            whole = getattr(m, name)
            if whole is None:
                continue
            # by expert over "ep", then by the next dim over "edp" (FSDP of the experts; of size 1 when ep = dp_shard)
            p = nn.Parameter(distribute_tensor(whole, grid, [Replicate()] * (mesh.ndim - 1) + [Shard(0), Shard(1)]))
            setattr(m, name, p)
            held.add(p)
        m.exchange = exchange
    return held


def expert_numel(module: nn.Module) -> int:
    """Elements of the expert weights this rank holds by expert parallelism in `module` (FSDP2 never gathers them; the
    memory estimate leaves them out of its buffers); 0 without EP."""
    gpt = sum(p.to_local().numel() for m in module.modules() if isinstance(m, MoE) and m.exchange for p in expert_params(m))
    hub = (m for m in module.modules() if getattr(m, "held_by_expert_parallel", False))  # parallel/hf_expert_parallel.py
    return gpt + sum(p.to_local().numel() for m in hub for p in m.parameters(recurse=False))


def expert_params(m: MoE) -> list[nn.Parameter]:
    return [p for p in (getattr(m, n) for n in EXPERT_WEIGHTS) if p is not None]
