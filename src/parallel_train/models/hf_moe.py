"""A Hugging Face mixture of experts' numbers: how many routed experts, how many each token is sent to, and the
parameters a token does not use (for MFU and the start banner: models/hf.py active_params, flops_per_token).

Each token runs `num_experts_per_tok` (top-k) of a layer's routed experts, so (n_experts - top_k) / n_experts of the
routed experts' parameters do no work for it. The counts come from the config (Qwen3-MoE's `num_experts`, Mixtral's
and GPT-OSS's `num_local_experts`, DeepSeek-V3's `n_routed_experts`); the routed experts' parameters are found by name:
those under a module named `experts` (`model.layers.3.mlp.experts.gate_up_proj`), not a shared expert
(`shared_experts`, which every token runs) nor the router (`mlp.gate`, `mlp.router`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # the families' names for the routed experts


def experts_and_top_k(config: Any) -> tuple[int, int] | None:
    """(routed experts per layer, experts each token is sent to), or None for a dense model."""
    text = config.get_text_config()
    n = next((getattr(text, key) for key in EXPERT_COUNTS if isinstance(getattr(text, key, None), int)), 0)
    k = getattr(text, "num_experts_per_tok", None)
    return (n, k) if n and isinstance(k, int) and 0 < k <= n else None


def is_routed_expert(name: str) -> bool:
    """A parameter of the routed experts (`...mlp.experts.down_proj`, `...mlp.experts.3.w1.weight`)."""
    return "experts" in name.split(".")[:-1]


def unused_params(model: nn.Module, frozen: bool = False) -> int:
    """The parameters a token does not use: the routed experts it is not sent to, (n - k) / n of theirs (0 for a dense
    model). `frozen`: only those of frozen parameters (LoRA's base)."""
    counts = experts_and_top_k(model.config)
    if counts is None:
        return 0
    n, k = counts
    routed = sum(p.numel() for name, p in model.named_parameters() if is_routed_expert(name) and not (frozen and p.requires_grad))
    return routed * (n - k) // n
