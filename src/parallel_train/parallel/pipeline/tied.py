"""A tied weight across pipeline stages: each rank holding it keeps a copy, and the copies stay equal.

A model that ties its output layer to its token embedding (GPT-2, `decoder.weight = encoder.weight`; models/ties.py)
puts one weight into the first and the last stage. Megatron-LM's answer, used here for any tie: every rank whose
stages hold a name of the weight keeps a copy (all start from the owner's values: parallel/model_init.py), and after the
backward of each optimizer step the copies' gradients are summed over a small process group of exactly those
ranks, one per data-parallel and tensor-parallel coordinate. Each copy then holds the gradient the unsplit model
computes for its one tensor, the optimizers (same state, same update) keep the copies equal, and the tied model
trains like the unsplit one. The global gradient norm counts the weight once (on the lowest such pipeline rank).

Stages on one rank (zbv and dualpipev put the first and the last stage on rank 0; a split that keeps both parts
in one stage) share the tensor itself: no group, nothing to sum. Where FSDP2 wraps two stages of one rank apart, a
rank may hold two copies; they are summed too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.models.ties import tie_groups
from parallel_train.parallel.mesh import MeshLayout
from parallel_train.parallel.model_init import local_view


def stages_holding(names: list[str], plan: list[list[str]]) -> list[int]:
    """The stages whose units hold one of the parameter `names` (a unit holds the names it prefixes)."""
    return sorted({s for s, units in enumerate(plan) for u in units for n in names if n.startswith(u + ".")})


@dataclass
class Tie:
    names: list[str]  # owner first, then its aliases
    pp_ranks: list[int]  # the pipeline ranks whose stages hold one of the names
    copies: list[torch.Tensor] = field(default_factory=list)  # this rank's distinct parameters among the names
    group: object = None  # the process group of this rank's copies on the other pipeline ranks (None: all here)


class TiedAcrossStages:
    """Built by every rank at the same point (creating process groups is a collective), after `local` has memory.

    `plan`: the unit names of each stage; `where`: stage -> pipeline rank; `local`: this rank's view of its stages."""

    def __init__(self, ties: dict[str, str], plan: list[list[str]], where: dict[int, int], layout: MeshLayout, rank: int, local: nn.Module):
        mine = layout.coordinate(rank)
        self.ties: list[Tie] = []
        for names in tie_groups(ties).values():
            pp_ranks = sorted({where[s] for s in stages_holding(names, plan)})
            tie = Tie(names, pp_ranks)
            for ranks in self._lines(layout, pp_ranks):  # every rank creates every group, in the same order
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    tie.group = group
            held = {id(p): p for n, p in local.named_parameters(remove_duplicate=False) if n in names}
            tie.copies = list(held.values())
            if tie.copies:
                self.ties.append(tie)
        self.pp_rank = mine["pp"]

    @staticmethod
    def _lines(layout: MeshLayout, pp_ranks: list[int]) -> list[list[int]]:
        """For each data-parallel, context-parallel and tensor-parallel coordinate (each holds its own shard of the weight),
        the global ranks at pipeline ranks `pp_ranks`."""
        lines: dict[tuple, list[int]] = {}
        for r in range(layout.world):
            c = layout.coordinate(r)
            if c["pp"] in pp_ranks:
                lines.setdefault((c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"]), []).append(r)
        return [lines[k] for k in sorted(lines)]

    @property
    def spans_ranks(self) -> bool:
        return any(tie.group is not None or len(tie.copies) > 1 for tie in self.ties)

    def sum_gradients(self) -> None:
        """Give every copy the sum of all copies' gradients (the unsplit model's gradient of the one weight). A
        collective over each tie's group; call after the step's backward, before the gradient norm."""
        for tie in self.ties:
            if tie.group is None and len(tie.copies) == 1:
                continue  # one tensor: autograd already added up its uses
            total = torch.zeros_like(local_view(tie.copies[0]))
            for p in tie.copies:
                if p.grad is not None:
                    total += local_view(p.grad)
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for p in tie.copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_view(p.grad).copy_(total)

    def not_counted(self) -> set[int]:
        """Parameters (ids) the global gradient norm leaves out: every copy but one, so a tied weight counts once."""
        out: set[int] = set()
        for tie in self.ties:
            counted_here = self.pp_rank == tie.pp_ranks[0]
            out.update(id(p) for p in tie.copies[1 if counted_here else 0 :])
        return out
