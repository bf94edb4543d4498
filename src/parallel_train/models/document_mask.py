"""Attention that keeps packed documents apart, for the template's own models (GPT).

A packed row (data.packing, data/packing.py) holds several samples one after the other, and `positions` gives each
token its position inside its own sample. A document starts wherever the positions do not continue by one (the
rule transformers' `find_packed_sequence_indices` uses, so a template model and a Hugging Face model draw the
same borders). A token then attends causally, and only within its own document: a block-diagonal causal mask.

- CPU (and any device without a better kernel): `F.scaled_dot_product_attention` with that boolean mask,
  (B, 1, T, T), built once per forward and shared by every layer.
- CUDA: flex attention (`torch.nn.attention.flex_attention`) with a block mask built from the same rule, which
  skips the blocks the mask leaves empty instead of computing and discarding them (compiled once per process).
Unpacked batches (no positions) keep SDPA's `is_causal` kernel: nothing here runs for them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the index of each token's document within its row."""
    first = positions[:, :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def boolean_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) True where query t may attend key s: s <= t and both in one document."""
    docs = document_ids(positions)
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


@cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(positions: torch.Tensor) -> Any:
    """flex attention's BlockMask for the same rule (CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(positions)

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    B, T = positions.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=positions.device)


def for_positions(positions: torch.Tensor | None, flex: bool | None = None) -> Any:
    """What attention needs to keep the documents of a packed batch apart: None for an unpacked batch (causal
    attention), a flex BlockMask on CUDA, else the boolean mask. `flex` forces the choice (tests)."""
    if positions is None:
        return None
    use_flex = positions.device.type == "cuda" if flex is None else flex
    return block_mask(positions) if use_flex else boolean_mask(positions)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of (B, heads, T, head_dim) tensors within `mask`'s documents (see for_positions)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    flex = _compiled_flex() if q.device.type == "cuda" else _eager_flex()
    return flex(q, k, v, block_mask=mask)  # no dropout in flex attention: the rare packed run with dropout uses the CPU path


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
