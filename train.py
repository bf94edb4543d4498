#!/usr/bin/env python3
"""Train a model on any topology: `python train.py`, `accelerate launch train.py`, `torchrun train.py`.

    python train.py --help                                  every config key
    python train.py --config configs/shakespeare_char_cpu.yaml train.max_steps=500
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml train.py

The loop lives in src/parallel_train/trainer.py; the model in src/parallel_train/models/.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a clone, no install step

from parallel_train.cli import main  # noqa: E402
from parallel_train.errors import run_cli  # noqa: E402

if __name__ == "__main__":
    run_cli(main)
