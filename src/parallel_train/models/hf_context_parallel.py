"""Context parallelism (parallel.cp) for a Hub decoder (model.name=hf): the Ulysses exchange as a transformers attention
function.

Each rank holds T/cp of every sequence (parallel/context_parallel.py). The decoder's own layers run on that part: its
position_ids are the part's place in the whole sequence (or its part of a packed batch's positions), so the rotary
tables are right. Attention is the one place that needs the whole sequence: transformers picks a model's attention
function by name from its registry (`AttentionInterface.register`, `config._attn_implementation`), so the model's own
attention modules stay as they are and call ATTENTION here, which runs one all-to-all to the whole sequence for
heads/cp of the heads, transformers' own SDPA function there, and one all-to-all back. The layers receive the exchange
(`context_parallel`) and the whole sequence's mask (None: causal; a packed batch's document mask) as keyword arguments
(hf_layouts.LayerInputs), which transformers hands on to the attention function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel_train.errors import UserError
from parallel_train.models import document_mask, hf_moe

ATTENTION = "parallel_train_ulysses"


def ulysses_sdpa(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, context_parallel=None, **kwargs
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, heads, T/cp, D) parts -> ((B, T/cp, heads, D) output, None).
    `attention_mask` is the whole sequence's (LayerInputs), as attention sees it after the exchange."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cp = context_parallel
    if cp is None:
        raise RuntimeError(f"{ATTENTION} attention runs under parallel.cp > 1 only (hf_layouts.run_decoder hands it the exchange)")
    q, k, v = (cp.to_sequence(t) for t in (query, key, value))  # the whole sequence, heads/cp of q's and of k/v's
    y, _ = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)  # (B, T, heads/cp, D)
    return cp.to_heads(y.transpose(1, 2)).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_sdpa)


def use(model: nn.Module, cp) -> None:
    """Run `model` (an HFModel) on this rank's part of each sequence through `cp`'s exchange; one-line errors for what the
    exchange cannot cut (decided from the config: every rank raises alike)."""
    text = model.hf.config.get_text_config()
    what = f"parallel.cp={cp.size}: model.hf_path {model.hf_path!r} ({text.model_type})"
    if model.layout is None or hf_moe.experts_and_top_k(text):  # a mixture of experts: its balancing loss counts whole rows
        raise UserError(
            f"{what}: context parallelism runs the dense causal decoders of a known layout (Llama, Mistral, Qwen, GPT-2); set parallel.cp=1"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % cp.size or kv_heads % cp.size:
        raise UserError(
            f"{what} has {heads} attention heads and {kv_heads} key/value heads; cp must divide both "
            "(the exchange gives each rank whole heads); choose a parallel.cp that does"
        )
    if getattr(text, "sliding_window", None) or "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        raise UserError(f"{what} has sliding-window layers, which the exchange does not mask; set parallel.cp=1")
    register()
    model.hf.set_attn_implementation(ATTENTION)
    model.context_parallel = cp


def whole_mask(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The whole sequence's mask after the exchange: None (causal) unpacked, else the packed documents' (B, 1, T, T)."""
    return None if positions is None else document_mask.boolean_mask(positions)
