"""The keys every model has, and the base of each model's own keys.

A model declares its own keys as a dataclass that extends `ModelConfig` next to the model itself (see
models/gpt.py), with a `check()` for the rules that tie its keys together. The config layer (config/load.py) then
parses `model.<key>=value` into the chosen model's class, applies only that model's rules, and lists every
model's keys in `train.py --help`. Adding a model never touches config/load.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_train.core.fields import opt
from parallel_train.core.task import DEFAULT, TASK_NAMES


@dataclass
class ModelConfig:
    name: str = opt("gpt", "model to build (see parallel_train/models/__init__.py)")
    block_size: int = opt(64, "context length in tokens (text data is cut into windows of this length)", min=1)
    vocab_size: int = opt(0, "0: take it from the data; else pad the vocab up to this size", min=0)
    task: str = opt(DEFAULT, "what the model learns (tasks.py): its labels, loss units and metrics", choices=TASK_NAMES)
    # What forward() takes (a class attribute, not a key): checked against what the data gives (Data.inputs) at
    # start, so a model given the wrong data stops in one line instead of a dtype error inside its first layer.
    inputs = "token ids"
    # The tasks this model can be built for (model.task); a model of your own lists the ones its forward serves.
    tasks = (DEFAULT,)

    def check(self) -> None:
        """Rules between this model's keys (ranges are checked from the fields): raise UserError naming the key."""

    def own_tokenizer(self) -> str | None:
        """The tokenizer this model comes with, which data.tokenizer defaults to when not set (None: the data's own
        default). A pretrained model's token ids mean nothing with any other tokenizer."""
        return None
