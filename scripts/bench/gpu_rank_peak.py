#!/usr/bin/env python3
"""train.py with each rank's peak GPU memory written beside the run: GPU_PEAK_DIR/rank<R>.json, {"allocated_mb":
torch.cuda.max_memory_allocated, "reserved_mb": max_memory_reserved} over the whole run, rewritten after every
optimizer step (summary.json holds rank 0's alone).

    GPU_PEAK_DIR=DIR torchrun --nproc-per-node N scripts/bench/gpu_rank_peak.py KEYS...

Run by scripts/bench/gpu_moe.sh. The run itself is train.py's, unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))


def record_peaks(out: Path) -> None:
    import torch

    from parallel_train import trainer

    original = trainer.Trainer.train_step

    def train_step(self):
        result = original(self)
        if torch.cuda.is_available():
            peaks = {"allocated_mb": torch.cuda.max_memory_allocated() / 2**20, "reserved_mb": torch.cuda.max_memory_reserved() / 2**20}
            (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peaks))
        return result

    trainer.Trainer.train_step = train_step


def main() -> None:
    out = Path(os.environ["GPU_PEAK_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    record_peaks(out)
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
