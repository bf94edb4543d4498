"""Peak FLOP/s of known accelerators, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import os

import torch

# Dense peak TFLOP/s (no sparsity) from the vendors' data sheets, per GPU.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """FLOP/s of one device at this precision; PEAK_TFLOPS env var overrides; None when unknown (e.g. CPU)."""
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for gpu, peaks in PEAK_TFLOPS.items():
        if gpu in name:
            return peaks["bf16" if precision in ("bf16", "fp16") else "tf32"] * 1e12
    return None
