"""The classic two-layer seed example: Linear(10, 50) -> ReLU -> Linear(50, 10).

Written as named parts (fc1, act, fc2) so the pipeline splitter can cut it like any other model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel_train.core.fields import opt
from parallel_train.core.model_config import ModelConfig


@dataclass
class MLPConfig(ModelConfig):
    """The seed MLP's own keys. With data.path=random, the data takes its shape from them too."""

    in_features: int = opt(10, "input width", min=1)
    hidden: int = opt(50, "hidden width", min=1)
    out_features: int = opt(10, "number of classes", min=1)
    inputs = "feature vectors"  # float rows of in_features values, not token ids


class SeedMLP(nn.Module):
    Config = MLPConfig  # its keys: what model.name=mlp accepts

    def __init__(self, cfg: MLPConfig, vocab_size: int = 0):
        super().__init__()
        self.fc1 = nn.Linear(cfg.in_features, cfg.hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(cfg.hidden, cfg.out_features)

    def init_weights(self, name: str, module: nn.Module) -> None:
        """torch's own initialisation of one layer (parallel/model_init.py calls it under a seed keyed by the layer's name)."""
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in (self.fc1, self.act, self.fc2):
            if part is not None:  # a pipeline stage keeps only some parts
                x = part(x)
        return x

    def flops_per_token(self) -> int:
        return 6 * sum(p.numel() for p in self.parameters())
