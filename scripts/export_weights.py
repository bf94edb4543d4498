#!/usr/bin/env python3
"""Write a checkpoint's model weights as whole tensors in safetensors, under the plain model's parameter names.

    python scripts/export_weights.py runs/x/checkpoints/step_0001000 exported/
    python scripts/export_weights.py runs/x exported/                          # the run's newest valid checkpoint
    python scripts/export_weights.py runs/x exported/ --max-shard-size 5GB     # shards + model.safetensors.index.json

A checkpoint holds each rank's part (DDP, FSDP2, tensor parallel or pipeline; any number of processes); the export
is one `model.safetensors`, or, past --max-shard-size, `model-00001-of-0000N.safetensors` files plus a
`model.safetensors.index.json` weight map, as Hugging Face stores large models. One process, one whole tensor in
memory at a time (src/parallel_train/checkpoint/export.py). The checkpoint's manifest is verified first, and a
folder holding a pickle is refused. A finished run's own model.safetensors is this export of its last checkpoint.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.errors import UserError, run_cli  # noqa: E402

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py (argparse prints usage too)
        raise UserError(f"{message} (see --help)")


def size_bytes(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size: {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def main() -> int:
    p = Parser(description="Export a checkpoint's weights as safetensors (whole tensors, canonical names).")
    p.add_argument("checkpoint", type=Path, help="a checkpoints/step_* folder, or a run's output_dir (its newest valid checkpoint)")
    p.add_argument("out_dir", type=Path, help="folder for model.safetensors (or its shards and index)")
    p.add_argument("--max-shard-size", default=None, help="split into files of at most this size, e.g. 5GB (default: one file)")
    args = p.parse_args(sys.argv[1:])
    limit = size_bytes(args.max_shard_size) if args.max_shard_size else None

    from parallel_train.checkpoint.export import export
    from parallel_train.run.resume import choose_checkpoint

    if not args.checkpoint.is_dir():
        raise UserError(f"{args.checkpoint}: no such folder; give a checkpoints/step_* folder or a run's output_dir")
    folder = choose_checkpoint(
        str(args.checkpoint), args.checkpoint / "checkpoints", warn=lambda m: print(f"warning: {m}", file=sys.stderr)
    )
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UserError(f"{args.out_dir}: is a file; give a folder")
    for path in export(folder, args.out_dir, limit):
        print(path)
    return 0


if __name__ == "__main__":
    run_cli(main)
