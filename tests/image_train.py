"""train.py with one model more: a tiny image classifier registered the way a user adds a model (docs/guide.md),
so that imagefolder data (model.task=image-classification, tasks/image_folder.py) trains through the real Trainer,
checkpoints and resume before `model.name=hf` builds transformers' image models. Run like train.py:

    python tests/image_train.py model.name=tinyvision model.task=image-classification model.hf_path=PROCESSOR data.path=FOLDER
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from parallel_train.cli import main  # noqa: E402
from parallel_train.config.fields import opt  # noqa: E402
from parallel_train.config.model import ModelConfig  # noqa: E402
from parallel_train.errors import run_cli  # noqa: E402
from parallel_train.models import MODELS  # noqa: E402


@dataclass
class TinyVisionConfig(ModelConfig):
    hf_path: str = opt("", "the folder of the image processor (preprocessor_config.json)")
    image_size: int = opt(16, "height and width of pixel_values", min=1)
    tasks = ("image-classification",)
    inputs = "images"


class TinyVision(nn.Module):
    """pixel_values (B, 3, S, S) -> class logits (B, classes): one Linear layer."""

    Config = TinyVisionConfig

    def __init__(self, cfg: TinyVisionConfig, vocab_size: int):
        super().__init__()
        self.head = nn.Linear(3 * cfg.image_size**2, vocab_size)  # the data's vocab_size: its number of classes

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(pixel_values.flatten(1))


MODELS["tinyvision"] = TinyVision

if __name__ == "__main__":
    run_cli(main)
