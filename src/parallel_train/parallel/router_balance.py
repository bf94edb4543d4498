"""The router's balancing loss over the data-parallel batch, and the experts' load for the log (models/moe.py).

Switch Transformer's loss, per MoE layer: N * sum_i f_i * P_i, with N experts, f_i the fraction of the (token, expert)
assignments that went to expert i (its count / (tokens x k)) and P_i the mean router probability of expert i. The run's
term is `model.moe_aux_loss_coef` x the mean over the layers (1.0 when the load is even, N when one expert takes all).

Over the whole data-parallel batch: after each micro-batch's forward, every rank's per-expert counts and probability sums
are summed over the data-parallel ranks (one all-reduce of a (layers, 2N) tensor), so f_i and P_i are those of the
micro-batch of every rank together, as Qwen's global-batch balancing counts them. Each rank then backpropagates its own
tokens' share of the P_i (x dp_size: the engines' gradient sync averages over the ranks), so the gradient is that of the
global micro-batch's loss: 1 process, DDP and FSDP2 give the same numbers. Gradient accumulation computes the loss per
micro-batch (each micro-batch over all ranks) and averages over the step's micro-batches.

The logged `aux_loss` (the unweighted loss, averaged over the micro-batches since the last log) and `expert_load` (per
layer, the busiest expert's count over the mean count: 1.0 is even) stay on the device between log steps and are
read once there (`report`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel_train.core.collectives import all_reduce_small
from parallel_train.models.moe import MoE


class RouterBalance:
    """`layers`: what keeps each MoE layer's statistics of its last forward in `last` (models/moe.py's MoE, or a
    RouterTap), with its `n_experts` and `top_k`. A pipeline stage's (parallel/pipeline/balance.py): `group`, the ranks
    holding the same layers (`peers` of them); `n_layers`, the whole model's MoE layers, which the loss averages over."""

    def __init__(self, layers: list, coef: float, dp_size: int, device: torch.device, group=None, peers: int = 0, n_layers: int = 0):
        self.layers, self.coef, self.dp_size, self.device, self.group = layers, coef, dp_size, device, group
        self.world = peers or (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        self.n_layers = n_layers or len(layers)
        self.n_experts = layers[0].n_experts
        self._loss = torch.zeros((), dtype=torch.float64, device=device)  # summed over micro-batches since the last report
        self._counts = torch.zeros(len(layers), self.n_experts, dtype=torch.float64, device=device)
        self._micro = 0

    def term(self, micro_batches: int) -> torch.Tensor | None:
        """After one micro-batch's forward (a collective): this rank's share of the weighted balancing loss, to add to
        what it backpropagates (after the engine's per-token scale); None when model.moe_aux_loss_coef=0."""
        stats = [m.last for m in self.layers]
        for m in self.layers:
            m.last = None
        counts = torch.stack([c for c, _ in stats]).to(torch.float64)  # (layers, N), this rank's tokens
        sums = torch.stack([s for _, s in stats])  # (layers, N) summed probabilities, with gradient
        both = torch.cat([counts, sums.detach().to(torch.float64)], dim=1)
        # Summed over every rank (or the stage's); tensor-parallel peers count a batch again (world / dp_size copies).
        both = all_reduce_small(both, torch.distributed.ReduceOp.SUM, self.device, self.group) * (self.dp_size / self.world)
        total, total_sums = both[:, : self.n_experts], both[:, self.n_experts :]
        assignments = total.sum(dim=1, keepdim=True)  # tokens x k, per layer
        tokens = assignments / self.layers[0].top_k
        fraction = total / assignments  # f_i
        self._loss += (self.n_experts * fraction * total_sums / tokens).sum() / self.n_layers  # the mean over the layers
        self._counts += total
        self._micro += 1
        if not self.coef:
            return None
        mine = (self.n_experts * fraction.float() * sums.float() / tokens.float()).sum() / self.n_layers  # this rank's tokens' part
        return self.coef * mine * self.dp_size / micro_batches

    def extra(self, micro_batches: int, scale: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """`term` in the units of a micro-batch's summed token loss, which the engines multiply by `scale` before
        backward (parallel/engine.py `accumulate`)."""

        def after_forward() -> torch.Tensor | None:
            t = self.term(micro_batches)
            return None if t is None else t / scale

        return after_forward

    def report(self) -> dict[str, float | list[float]]:
        """`aux_loss` and `expert_load` since the last report, read from the device (log steps only: one read)."""
        if not self._micro:
            return {}
        load = self._counts.max(dim=1).values / self._counts.mean(dim=1).clamp(min=1e-30)
        values = torch.cat([(self._loss / self._micro).reshape(1), load]).tolist()
        self._loss.zero_(), self._counts.zero_()
        self._micro = 0
        return {"aux_loss": values[0], "expert_load": values[1:]}


class RouterTap:
    """A transformers MoE layer's router, watched by a forward hook: its logits -> the statistics models/moe.py keeps in
    `last`, computed as transformers' `load_balancing_loss_func` does (softmax over all experts, the top k of it)."""

    def __init__(self, router: nn.Module, index: int, n_experts: int, top_k: int):
        self.index, self.n_experts, self.top_k = index, n_experts, top_k
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args, output) -> None:
        logits = output[self.index] if isinstance(output, tuple) else output
        probs = F.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
        experts = torch.topk(probs, self.top_k, dim=-1).indices
        self.last = (torch.bincount(experts.reshape(-1), minlength=self.n_experts), probs.sum(dim=0))


def router_spec(hf: nn.Module) -> tuple[type, int, int, int] | None:
    """A transformers MoE model's router class (what its `_can_record_outputs["router_logits"]` records), the index of
    the logits in the router's output, its experts and top k; None for a model without routers."""
    spec = (getattr(hf, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    target, index = (spec.target_class, spec.index) if hasattr(spec, "target_class") else (spec, 0)
    config = hf.config.get_text_config()
    n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (target, index, n_experts, top_k) if target and n_experts and top_k else None


def hub_routers(hf: nn.Module, part: nn.Module | None = None, tap: bool = True) -> list:
    """The routers of a transformers MoE model (those under `part`, a pipeline stage's view of it, when given), tapped;
    `tap=False`: the router modules themselves, untouched (to count them)."""
    spec = router_spec(hf)
    if spec is None:
        return []
    target, index, n_experts, top_k = spec
    routers = [m for m in (hf if part is None else part).modules() if isinstance(m, target)]
    return [RouterTap(m, index, n_experts, top_k) for m in routers] if tap else routers


def moe_layers(model: nn.Module, part: nn.Module | None = None, tap: bool = True) -> list:
    """What the balancing loss reads of `model` (of `part`, a pipeline stage's view of it, when given): the GPT's MoE
    layers, or a transformers MoE model's routers (`model.hf`), tapped unless `tap=False`."""
    layers = [m for m in (model if part is None else part).modules() if isinstance(m, MoE)]
    hf = getattr(model, "hf", None)
    return hub_routers(hf, part, tap) if not layers and isinstance(hf, nn.Module) else layers


def aux_loss_coef(model: nn.Module, cfg) -> float:
    """model.moe_aux_loss_coef, or for a transformers model when it is < 0, the model's own router_aux_loss_coef."""
    coef = getattr(cfg.model, "moe_aux_loss_coef", 0.0)
    hf = getattr(model, "hf", None)
    if coef < 0 and isinstance(hf, nn.Module) and not any(isinstance(m, MoE) for m in model.modules()):
        coef = getattr(hf.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0
    return max(coef, 0.0)


def router_balance(model: nn.Module, cfg, dp_size: int, device: torch.device) -> RouterBalance | None:
    """The balancing loss of `model`'s MoE layers (None: it has none): the GPT's experts, or a transformers MoE model's
    routers. `cfg`: the run's config; model.moe_aux_loss_coef < 0: the transformers model's own router_aux_loss_coef."""
    layers = moe_layers(model)
    return RouterBalance(layers, aux_loss_coef(model, cfg), dp_size, device) if layers else None
