"""A copy of a module with meta copies of its tensors: its shape and attributes, none of its memory.

parallel/model_init.py keeps a childless one of every module (what it fills later, whatever splitting and sharding
do to the module itself); models/hf_init.py keeps one of a whole transformers model's tree (the parents whose
initialisation reaches into their children's parameters).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def meta_copy(module: nn.Module, children: bool = False) -> nn.Module:
    """`module` with meta copies of its own parameters and buffers, no hooks; its children dropped, or (children=True)
    meta copies of them in turn."""
    twin = copy.copy(module)
    twin.__dict__ = dict(module.__dict__)
    twin._parameters = {
        n: (None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)) for n, p in module._parameters.items()
    }
    twin._buffers = {n: (None if b is None else torch.empty_like(b, device="meta")) for n, b in module._buffers.items()}
    twin._forward_hooks, twin._forward_pre_hooks = {}, {}
    twin._modules = {n: (None if c is None else meta_copy(c, True)) for n, c in module._modules.items()} if children else {}
    return twin
