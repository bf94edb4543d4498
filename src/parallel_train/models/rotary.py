"""Rotary position embeddings (RoPE) for the GPT's llama flavor (`model.flavor=llama`), as transformers' Llama and
Mixtral compute them, so that an exported model's logits equal the GPT's.

    frequencies  theta^(-2i/head_dim) for i < head_dim/2 (`model.rope_theta`), times each token's position, in float32
    cos, sin     of those angles, each repeated twice along head_dim: (B or 1, T, head_dim)
    rotate       q * cos + rotate_half(q) * sin (the first half of head_dim paired with the second, not interleaved)

The angles come from the positions the GPT gives (gpt.py): 0..T-1, a packed batch's positions within each sample,
this rank's part of the sequence under context parallelism, so every layout rotates each token by its place in the
whole sequence. Computed each forward from the positions (a few T x head_dim values): no buffer to build on the meta
device or to keep in a checkpoint.
"""

from __future__ import annotations

import torch


def angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (T,) or (B, T) -> (cos, sin), each (1 or B, 1, T, head_dim) to broadcast over the heads."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    pos = positions.reshape(-1, positions.shape[-1]).float()  # (B or 1, T)
    freqs = pos[..., None] * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, head_dim) queries or keys rotated by their tokens' angles."""
    return x * cos + rotate_half(x) * sin
