"""Expert parallelism (`parallel.ep=N`) for a Hugging Face mixture of experts (model.name=hf: Qwen3-MoE, Mixtral,
DeepSeek-V3): the same layout as the GPT's (parallel/expert_parallel.py), on transformers' own experts module.

Written here, not transformers 5.24's EP plan: its `DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation=
"all_to_all")` runs on 2 gloo ranks, but only inside `from_pretrained`, which builds its own mesh, loads whole and applies
its own fully_shard (experts over its "efsdp"); the trainer builds on the meta device, fills each rank's slices itself
and runs FSDP2 on its own dp_shard mesh, so only the token exchange could be shared, and that is the GPT's.

The experts module (`...mlp.experts`) stores every expert's weights stacked (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and runs `forward(hidden_states, top_k_index, top_k_weights)`. Under EP each of its weights is a DTensor
(Shard(0) over "ep", Shard(1) over "edp") that FSDP2 leaves alone, and its forward becomes:

    dispatch  the (token, expert) pairs sorted by expert, the per-expert counts exchanged, the rows sent to the ranks
              holding their experts (all_to_all_single, differentiable)
    compute   the module's own forward over the rows it got, with this rank's experts (gathered over "edp", gradients
              scaled by 1 / dp_shard as the GPT's), local expert ids and unit weights
    combine   the outputs sent back, put in the pairs' order and weighted by the router's top-k weights

The router, its balancing loss (router_balance.py taps it) and everything outside the experts module are unchanged;
checkpoints keep the canonical names, so an ep=2 checkpoint resumes on one process and the other way round.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from parallel_train.errors import UserError
from parallel_train.models.hf_moe import experts_and_top_k
from parallel_train.parallel.expert_parallel import local_tensor, scale_grad, split_sizes


def hub_experts(model: nn.Module) -> list[nn.Module]:
    """A transformers MoE's routed experts modules: `num_experts` stacked 3-D weights each (not a shared expert)."""
    found = []
    for name, m in model.named_modules():
        n, own = getattr(m, "num_experts", None), list(m.parameters(recurse=False))
        if name.split(".")[-1] == "experts" and isinstance(n, int) and own and all(p.dim() == 3 and p.shape[0] == n for p in own):
            found.append(m)
    return found


class HubExpertExchange:
    """One experts module's forward under EP (see the module docstring)."""

    def __init__(self, experts: nn.Module, group, ep: int, dp: int):
        self.experts, self.forward = experts, experts.forward
        self.group, self.ep, self.dp, self.n = group, ep, dp, experts.num_experts

    @torch.compiler.disable  # the split sizes are read on the host
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all

        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        _, send, recv, expert_of = split_sizes(torch.bincount(flat, minlength=self.n), self.ep, self.group)
        got = all_to_all(hidden_states[order // k], recv, send, self.group)
        ids = expert_of.unsqueeze(-1)
        with self.local_experts(got.dtype) as weights:
            out = self.forward(got, ids, torch.ones(ids.shape, dtype=got.dtype, device=got.device))
        # A rank whose experts got no rows (or missed one) still runs every backward collective, as its peers do: the
        # rows and its experts kept in the graph at zero cost (transformers' AllToAllEP keeps its empty rows alike).
        out = out + sum((w.sum() * 0 for w in weights if w.requires_grad), got.sum() * 0).to(out.dtype)
        back = all_to_all(out, send, recv, self.group)
        pairs = torch.empty_like(back).index_copy_(0, order, back).view(*top_k_index.shape, -1)
        return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1).to(hidden_states.dtype)

    @contextlib.contextmanager
    def local_experts(self, dtype: torch.dtype):
        """The module's weights as this rank's experts whole (plain tensors, gradients to the DTensors), its expert
        count theirs, for the length of its own forward."""
        m = self.experts
        held = dict(m._parameters)
        local = {name: scale_grad(local_tensor(p, dtype), 1.0 / self.dp) for name, p in held.items()}
        m._parameters.update(local)
        m.num_experts = self.n // self.ep
        try:
            yield list(local.values())
        finally:
            m._parameters.update(held)
            m.num_experts = self.n


def check_hub_layout(model_name: str, ep: int, dp_replicate: int, tp: int, pp: int) -> None:
    """One line for a mesh a Hub MoE's expert parallelism is not built for (the GPT's composes with HSDP, tp and pipeline
    stages, parallel/expert_parallel.py; a Hub model's experts run over the dp_shard ranks alone). Decided from the
    layout: every rank raises alike, before any collective."""
    if model_name == "hf" and ep > 1 and (dp_replicate > 1 or tp > 1 or pp > 1):
        raise UserError(
            f"parallel.ep={ep} with a Hugging Face MoE and dp_replicate={dp_replicate}, tp={tp}, pipeline_stages={pp}: "
            "its experts are split over the dp_shard ranks alone; set those to 1 (the template's GPT MoE composes with them)"
        )


def shard_hub_experts(model: nn.Module, mesh, ep: int) -> set[nn.Parameter]:
    """A transformers MoE's experts sharded over `mesh` (1-D, the dp_shard ranks) as parallel/expert_parallel.py's
    shard_experts shards the GPT's, their forward exchanging tokens; returns those parameters, for FSDP2 to ignore.
    Raises UserError (alike on every rank: the config decides) for a model without experts or with too few for ep."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if ep == 1 or not hasattr(model, "hf"):
        return set()
    layers = hub_experts(model.hf)
    config = getattr(model.hf, "config", None)
    if not layers and config is not None and experts_and_top_k(config):  # a MoE whose experts are not all (experts, in, out) tensors
        raise UserError(
            f"parallel.ep={ep}: the Hugging Face model's experts are not the stacked 3-d weights expert parallelism cuts here "
            "(GPT-OSS's carry 2-d biases); set parallel.ep=1 (FSDP2 shards its experts)"
        )
    if not layers or layers[0].num_experts % ep:
        got = f"{layers[0].num_experts} routed experts per layer" if layers else "no routed experts"
        raise UserError(f"parallel.ep={ep}: the Hugging Face model has {got}; set parallel.ep to a divisor of its experts, or 1")
    dp = mesh.size()
    grid = mesh._unflatten(0, (ep, dp // ep), ("ep", "edp"))  # dp_shard rank = ep rank x edp + edp rank
    group, held = grid["ep"].get_group(), set()
    for m in layers:
        for name, whole in list(m._parameters.items()):
            p = nn.Parameter(distribute_tensor(whole, grid, [Shard(0), Shard(1)]), requires_grad=whole.requires_grad)
            m._parameters[name] = p
            held.add(p)
        m.forward = HubExpertExchange(m, group, ep, dp)
        m.held_by_expert_parallel = True  # expert_parallel.expert_numel counts its weights as EP's, not FSDP2's
    return held
