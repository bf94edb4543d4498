"""The router's balancing loss on the stages of the multi-process pipeline (parallel/router_balance.py, models/moe.py).

Each stage's MoE layers (the GPT's, or a transformers MoE model's routers, tapped: router_balance.py `moe_layers`) get a
RouterBalance of their own. After each micro-batch's forward through the stage, its layers' counts are summed over the
ranks that hold the same stage (its data-parallel ranks and their tensor-parallel peers: one all-reduce, in the order
every one of them runs the schedule), and the stage's share of the weighted loss is tied to the stage's output by
`AuxLoss`: the identity forward, whose backward also gives the term the gradient 1 (times the fp16 loss scale) when the
stage's output gradient arrives. So every stage's layers, not only the last stage's, get their balancing gradient within
the schedule's own backward (Megatron-LM's MoEAuxLossAutoScaler). Each term divides by the whole model's MoE layers, so
the stages' terms add up to the unsplit model's mean over the layers.

The micro-batches are the pipeline's (A x parallel.microbatches per optimizer step), each over the data-parallel ranks:
the loss equals that of one process that runs the same micro-batches as gradient accumulation. The schedule's first
step also runs the stages on empty tensors to infer the shapes they send; `live`, set around the real forwards, leaves
those out. The log's `aux_loss` (the stages' parts summed) and `expert_load` (every layer, in the model's order) are
gathered over the pipeline ranks at log steps only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.core.collectives import all_gather
from parallel_train.parallel.mesh import MeshLayout
from parallel_train.parallel.router_balance import RouterBalance, aux_loss_coef, moe_layers


class AuxLoss(torch.autograd.Function):
    """`out` unchanged; backward passes its gradient on and gives `term` the gradient `unit()`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, term: torch.Tensor, unit: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.unit = unit
        return out.detach()  # the same memory, not a view: zero-bubble schedules detach a stage's output in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.unit(), None


def stage_peers(layout: MeshLayout, rank: int):
    """The process group of the ranks that hold this rank's stages (same pipeline coordinate); every rank creates all."""
    world, mine = layout.world, None
    for pp in range(layout.pp):
        ranks = [r for r in range(world) if layout.coordinate(r)["pp"] == pp]
        group = dist.new_group(ranks)
        mine = group if layout.coordinate(rank)["pp"] == pp else mine
    return mine


class StageBalance:
    """The balancing loss of this rank's stages (`mods`, stage indices `ids`, views of `model`: the whole model, which
    names its kind of MoE layer); `n_layers`: the whole model's MoE layers, `micro_batches`: per optimizer step; `unit()`:
    the gradient a term gets (the loss scale)."""

    def __init__(
        self,
        model: nn.Module,
        mods: list[nn.Module],
        ids: list[int],
        n_layers: int,
        coef: float,
        layout: MeshLayout,
        rank: int,
        device,
        pp_group,
    ):
        self.live, self.micro_batches, self.pp_group = False, 1, pp_group
        self.unit: Callable[[], torch.Tensor] = lambda: torch.ones((), device=device)
        group = stage_peers(layout, rank)
        peers = layout.world // layout.pp
        self.stages: dict[int, RouterBalance] = {}
        for mod, sid in zip(mods, ids, strict=True):
            layers = moe_layers(model, mod)
            if layers:
                self.stages[sid] = RouterBalance(layers, coef, layout.dp, device, group=group, peers=peers, n_layers=n_layers)
                mod.register_forward_hook(self._after(mod, self.stages[sid]))

    @classmethod
    def of(cls, model: nn.Module, mods: list[nn.Module], ids: list[int], engine, layout: MeshLayout) -> StageBalance | None:
        """The StageBalance of `engine`'s stages (`model`: the whole model, whose MoE layers the loss averages over), or
        None for a model without them."""
        n_layers = len(moe_layers(model, tap=False))
        if not n_layers:
            return None
        balance = cls(model, mods, ids, n_layers, aux_loss_coef(model, engine.cfg), layout, engine.rank, engine.device, engine.pp_group)
        balance.micro_batches = engine.M  # A x parallel.microbatches per optimizer step
        balance.unit = lambda: engine.precision.scale(torch.ones((), device=engine.device))  # the fp16 loss scale
        return balance

    def _after(self, mod: nn.Module, balance: RouterBalance):
        def hook(module: nn.Module, args, out):
            if module is not mod:  # the stage views share one dict of hooks (split.stage_module copies the model)
                return out
            if not self.live:  # the shapes' inference (or evaluation): no term, nothing counted
                for m in balance.layers:
                    m.last = None
                return out
            term = balance.term(self.micro_batches)
            return out if term is None or not torch.is_tensor(out) else AuxLoss.apply(out, term, self.unit)

        return hook

    def around(self, forward_one_chunk):
        """A stage's forward_one_chunk (the schedule's real forwards), with `live` set while it runs."""

        def wrapper(*args, **kwargs):
            self.live = True
            try:
                return forward_one_chunk(*args, **kwargs)
            finally:
                self.live = False

        return wrapper

    def report(self) -> dict[str, float | list[float]]:
        """`aux_loss` and `expert_load` of the whole model since the last report (a collective over the pipeline ranks)."""
        parts = [p for mine in all_gather([(sid, b.report()) for sid, b in self.stages.items()], self.pp_group) for p in mine]
        parts = [r for _, r in sorted(parts, key=lambda p: p[0]) if r]
        if not parts:
            return {}
        return {"aux_loss": sum(r["aux_loss"] for r in parts), "expert_load": [x for r in parts for x in r["expert_load"]]}
