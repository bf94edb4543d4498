"""The GPT's mixture of experts (`model.n_experts > 0`): the block's MLP replaced by `n_experts` MLPs of the same shape
(fc -> GELU -> proj, biases as model.bias says; the llama flavor's SwiGLU: silu(x @ gate) * (x @ fc) -> proj, no biases,
transformers' Mixtral experts with fc as `up` and proj as `down`) and a router that sends each token to `experts_per_token` of them.

    route     router logits (a Linear without bias) -> softmax over all experts (float32) -> the top k; their weights
              renormalised to sum to 1 (Qwen3-MoE's `norm_topk_prob=True`; Mixtral takes the same softmax of the top k)
    dispatch  the (token, expert) pairs sorted by expert: each expert's tokens one contiguous group (dropless: no
              capacity, no token dropped)
    compute   each expert's MLP over its group, the experts' weights stacked ([E, ...] tensors)
    combine   each pair's output times its weight, summed back into its token's row

`dispatch` and `combine` are separate so that expert parallelism can put its all-to-all between them (the tokens sent
to the ranks holding their experts, and back) without touching routing or compute.

Each forward keeps its routing statistics in `last` (per-expert counts of this forward's tokens, no gradient, and the
summed router probabilities, with gradient): parallel/router_balance.py turns them into the balancing loss over the
data-parallel batch and the logged expert load, and clears them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class MoE(nn.Module):
    def __init__(self, n_embd: int, hidden: int, n_experts: int, top_k: int, bias: bool, dropout: float, gated: bool = False):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        # Stacked weights, (in, out) per expert: x @ fc[e]. Parameters of this module itself: init_weights fills them.
        self.fc = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.proj = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.fc_bias = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.proj_bias = nn.Parameter(torch.empty(n_experts, n_embd)) if bias else None
        self.gate = nn.Parameter(torch.empty(n_experts, n_embd, hidden)) if gated else None  # SwiGLU's gate (llama flavor)
        self.drop = nn.Dropout(dropout)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (counts [E], probability sums [E]) of the last forward
        self.exchange = None  # expert parallelism (parallel/expert_parallel.py): rows, counts -> the experts' outputs

    def init_weights(self, std: float, proj_std: float) -> None:
        """GPT-2's start for the experts (as the dense MLP's fc and proj): normal weights, zero biases."""
        nn.init.normal_(self.fc, mean=0.0, std=std)
        nn.init.normal_(self.proj, mean=0.0, std=proj_std)
        if self.gate is not None:
            nn.init.normal_(self.gate, mean=0.0, std=std)
        for b in (self.fc_bias, self.proj_bias):
            if b is not None:
                nn.init.zeros_(b)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, C) -> router probabilities (N, E) in float32, the top k's weights (N, k) and experts (N, k)."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return probs, weights / weights.sum(dim=-1, keepdim=True), experts

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, C) and their experts (N, k) -> the N*k (token, expert) rows sorted by expert, each expert's
        tokens one group; the groups' sizes (E,); `order`, which pair each sorted row is (for combine)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: within an expert, tokens keep their order
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        return x[order // self.top_k], counts, order

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, weights: list | None = None) -> torch.Tensor:
        """Each expert's MLP over its contiguous group of `rows`. `weights`: (fc, fc_bias, proj, proj_bias, gate) to use
        instead of the module's (expert parallelism: this rank's experts only).

        A loop over the experts' groups: torch 2.13's `torch._grouped_mm` runs forward on the CPU but its backward
        fails there ("Invalid strides/sizes"), so it cannot train on a laptop. The group sizes are read on the host: on
        the CPU the host holds them already (`.numpy()`, no wait); on a GPU it is one sync per MoE layer, which a
        grouped GEMM with device offsets would remove (torchtitan's way) once it runs everywhere."""
        fc, fc_bias, proj, proj_bias, gate = weights or (self.fc, self.fc_bias, self.proj, self.proj_bias, self.gate)
        sizes = group_sizes(counts, rows.shape[0])
        outs = []
        for e, group in enumerate(torch.split(rows, sizes)):
            h = group @ fc[e]
            if fc_bias is not None:
                h = h + fc_bias[e]
            h = (F.gelu(h) if gate is None else F.silu(group @ gate[e]) * h) @ proj[e]
            outs.append(h if proj_bias is None else h + proj_bias[e])
        return torch.cat(outs)

    def combine(self, out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Sorted rows' outputs (N*k, C) -> each token's weighted sum over its k experts (N, C)."""
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros(n_tokens, out.shape[-1], dtype=out.dtype, device=out.device).index_add_(0, order // self.top_k, weighted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, weights, experts = self.route(tokens)
        rows, counts, order = self.dispatch(tokens, experts)
        out = self.compute(rows, counts) if self.exchange is None else self.exchange(self, rows, counts)
        y = self.combine(out, order, weights, tokens.shape[0])
        self.last = (counts.detach(), probs.sum(dim=0))
        return self.drop(y.reshape(shape))


def group_sizes(counts: torch.Tensor, rows: int) -> list[int]:
    """The experts' group sizes on the host. On fake tensors (the memory estimator, parallel/activation_memory.py: shapes
    only, no values) the groups are taken even, the load the balancing loss aims for."""
    if is_fake(counts):
        return [rows // len(counts) + (e < rows % len(counts)) for e in range(len(counts))]
    return counts.numpy().tolist() if counts.device.type == "cpu" else counts.tolist()
