"""Model registry: `model.name` -> the model class. A model class takes `(its config, vocab_size)`, and its
`Config` attribute is the dataclass of its keys (a `ModelConfig` with the model's own keys added).

To add your own model: put it and its config class in `models/<name>.py` and add one line to MODELS below;
nothing else changes (its keys appear in `train.py --help`, its rules apply only when it is chosen). The
model's `forward(inputs)` returns logits; the loss (losses.py) compares them with the targets. To be split into
pipeline stages, its top-level parts must be named modules (see gpt.py) and `forward` must skip parts that
are None.
"""

from __future__ import annotations

from torch import nn

from parallel_train.core.model_config import ModelConfig
from parallel_train.models.gpt import GPT
from parallel_train.models.hf import HFModel
from parallel_train.models.mlp import SeedMLP

MODELS: dict[str, type[nn.Module]] = {
    "gpt": GPT,
    "mlp": SeedMLP,
    "hf": HFModel,  # a transformers model of any model.task (optional extra: requirements-hf.txt)
}


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return MODELS[cfg.name](cfg, vocab_size)
