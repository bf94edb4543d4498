"""Model registry: `model.name` -> a builder `(ModelConfig, vocab_size) -> nn.Module`.

To add your own model: put it in `models/<name>.py` and add one line to MODELS below. The model's
`forward(inputs)` returns logits; the loss (losses.py) compares them with the targets. To be split into
pipeline stages, its top-level parts must be named modules (see gpt.py) and `forward` must skip parts
that are None.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from parallel_train.config import ModelConfig
from parallel_train.models.gpt import GPT
from parallel_train.models.mlp import SeedMLP

MODELS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "gpt": GPT,
    "mlp": SeedMLP,
}


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return MODELS[cfg.name](cfg, vocab_size)
