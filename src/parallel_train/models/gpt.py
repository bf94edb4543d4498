"""A small, clean GPT (decoder-only transformer) for character- or byte-level language modelling.

Layout (the names matter: the pipeline splitter cuts the model by these module names, and
checkpoints use them as parameter names whatever the topology):

    tok_emb, pos_emb      token and position embeddings
    blocks.0 .. blocks.N  transformer blocks (a ModuleDict, so names survive when a stage keeps a few)
    ln_f, head            final LayerNorm and the output projection to the vocabulary

`forward` tolerates missing parts (set to None by a pipeline stage): a stage without the embeddings
takes the previous stage's activations as input, a stage without the head returns activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel_train.config_fields import check, opt
from parallel_train.model_config import ModelConfig


@dataclass
class GPTConfig(ModelConfig):
    """The GPT's own keys (model.<key>=value), beside the keys every model has."""

    n_layer: int = opt(4, "transformer blocks", min=1)
    n_head: int = opt(4, "attention heads per block", min=1)
    n_embd: int = opt(128, "embedding width (divisible by n_head)", min=1)
    dropout: float = opt(0.0, "dropout probability", min=0.0, below=1.0)
    bias: bool = opt(True, "bias in Linear and LayerNorm layers")
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward: less memory, about 1/3 more compute")

    def check(self) -> None:
        check(self.n_embd % self.n_head == 0, f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Fused attention: flash / memory-efficient kernels on GPU, a fused kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    Config = GPTConfig  # its keys: what model.name=gpt accepts
    # forward uses these together: the pipeline splitter keeps them in one stage.
    pipeline_groups = (("tok_emb", "pos_emb", "drop"),)
    _no_split_modules = ["Block"]  # FSDP's unit (accelerate reads this name, as for transformers models)

    def __init__(self, cfg: GPTConfig, vocab_size: int):
        super().__init__()
        self.block_size = cfg.block_size
        self.activation_checkpointing = cfg.activation_checkpointing
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # Not tied to tok_emb: tying would couple the first and last pipeline stages.
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)

        # GPT-2 initialisation; residual projections scaled down by depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab). A pipeline stage may lack some parts."""
        if self.tok_emb is not None:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only the block's input; backward reruns its forward (same dropout masks: the RNG
                # state is saved), trading about a third more compute for the block's activations.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter plus attention (PaLM appendix B, as in nanoGPT)."""
        n_params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        n_layer, block = len(self.blocks), self.block_size
        n_embd = self.pos_emb.weight.shape[1]
        return 6 * n_params + 12 * n_layer * n_embd * block
