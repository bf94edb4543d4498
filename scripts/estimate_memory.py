#!/usr/bin/env python3
"""Memory per rank of a training run, before launching it: parameters, gradients, optimizer state and
activations (as model.activation_checkpointing keeps them, and fully checkpointed) for the mesh the keys describe, and whether it fits.

    python scripts/estimate_memory.py --world 8 --device h100 --config configs/gpt2_124m.yaml parallel.dp_shard=4 parallel.tp=2
    python scripts/estimate_memory.py --world 2 parallel.tp=2                     # the default model, 2 processes
    python scripts/estimate_memory.py --world 4 --json parallel.dp_shard=4        # machine-readable

Takes the same --config FILE and key=value overrides as train.py, plus the number of processes (--world) and a
device (--device, or --device-gib N). Nothing is allocated and no process is started: the model is built on the
meta device and cut by the same code a run uses (src/parallel_train/parallel/memory_estimate.py says how), so the
parameter count per rank equals the run's `local_param_numel` in summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.errors import UserError, run_cli  # noqa: E402


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py
        raise UserError(f"{message} (see --help)")


def processes(text: str) -> int:
    """--world: a whole number of processes, at least 1 (argparse names the option)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1 (the processes the run will launch)")
    return int(text)


def gib(text: str) -> float:
    """--device-gib: a finite number of GiB above 0 (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB above 0 (e.g. 80)")
    return value


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    from parallel_train.parallel.memory_estimate import DEVICE_GIB

    p = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--world", type=processes, required=True, help="processes the run will launch (GPUs)")
    p.add_argument("--device", default="h100", help=f"device to fit: {', '.join(DEVICE_GIB)}")
    p.add_argument("--device-gib", type=gib, help="memory of the device in GiB (instead of --device)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args, rest = p.parse_known_args(argv)
    if args.device_gib is None and args.device not in DEVICE_GIB:
        raise UserError(f"--device {args.device}: unknown; known: {', '.join(DEVICE_GIB)} (or give --device-gib N)")
    return args, rest


def _checkpointing(cfg) -> str:
    mode = getattr(cfg.model, "activation_checkpointing", "none")
    return f"{mode} ({cfg.model.selective_ac})" if mode == "selective" else mode


def report(cfg, layout, ranks, capacity_gib: float, device: str, total_params: int) -> str:
    from parallel_train.parallel.memory_estimate import USABLE

    usable = capacity_gib * USABLE * 2**30
    p = cfg.parallel
    worst, worst_ckpt = max(r.total() for r in ranks), max(r.total(True) for r in ranks)
    unit, scale = ("GiB", 2**30) if worst >= 2**30 else ("MiB", 2**20)

    def size(n: int | None) -> str:
        return "n/a" if n is None else f"{n / scale:,.2f}"

    lines = [
        f"mesh {layout.describe()} ({layout.world} processes) | {cfg.model.name}: {total_params / 1e6:.2f}M parameters | "
        f"micro-batch {cfg.train.batch_size // (p.microbatches if layout.pp > 1 else 1)} | precision {cfg.train.mixed_precision} | "
        f"optimizer {cfg.train.optimizer} | activation checkpointing {_checkpointing(cfg)}",
        "",
        f"| pipeline rank | stages | parameters held | parameters {unit} | gradients {unit} | optimizer {unit} | FSDP buffers {unit} | "
        f"pipeline buffers {unit} | working {unit} | activations {unit} | total {unit} | activations, full checkpointing | total, full checkpointing |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ranks:
        lines.append(
            f"| {r.pp_rank} | {','.join(map(str, r.stages))} | {r.param_numel:,} ({100 * r.param_numel / max(1, total_params):.1f}%) | "
            f"{size(r.params)} | {size(r.grads)} | {size(r.optimizer)} | {size(r.fsdp_buffers)} | {size(r.stage_buffers)} | {size(r.working)} | "
            f"{size(r.activations)} | {size(r.total())} | {size(r.activations_ckpt)} | "
            f"{size(r.total(True) if r.activations_ckpt is not None else None)} |"
        )
    verdict = "fits" if worst <= usable else "does NOT fit"
    lines += [
        "",
        f"{device} ({capacity_gib:g} GiB, {usable / 2**30:.1f} usable at {USABLE:.0%}): {verdict} "
        f"(largest rank {size(worst)} {unit})"
        + (
            f"; with model.activation_checkpointing=full: {'fits' if worst_ckpt <= usable else 'does NOT fit'} ({size(worst_ckpt)} {unit})"
            if any(r.activations_ckpt is not None for r in ranks)
            else ""
        ),
        "Every data-parallel and tensor-parallel rank of a pipeline rank holds about the same (rank 0 the largest slice).",
    ]
    return "\n".join(lines)


def main() -> int:
    args, rest = parse(sys.argv[1:])
    from parallel_train.config.load import load_config
    from parallel_train.parallel.memory_estimate import DEVICE_GIB, as_json, estimate_config

    cfg, _ = load_config(rest)
    layout, ranks, total = estimate_config(cfg, args.world)  # the data read as a run reads it, at its widest sample
    capacity = args.device_gib or DEVICE_GIB[args.device]
    if args.json:
        print(json.dumps({**as_json(layout, ranks), "total_params": total, "device_gib": capacity}, indent=1))
    else:
        print(report(cfg, layout, ranks, capacity, args.device if not args.device_gib else "the device", total))
    return 0


if __name__ == "__main__":
    run_cli(main)
