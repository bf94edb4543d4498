"""Mixed precision, one implementation for every engine: autocast, the fp16 loss scaler, FSDP2's policy.

`train.mixed_precision` (or the launcher's, with `auto`) is no, bf16 or fp16:
- bf16: no loss scaling (bf16 has fp32's exponent range). The mesh engine and the multi-process pipeline (FSDP2,
  tensor parallel, pipeline stages, with or without data-parallel replicas) wrap the model in FSDP2 with a
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: parameters are all-gathered in bf16 (half the bytes
  of fp32; over one data-parallel rank only copied) and the layers compute in bf16 without autocast, so what they save
  for backward is bf16, while gradients are reduced in fp32 and the optimizer keeps fp32 master weights
  (parallel/sharding.py: `fsdp_wraps`). One process, DDP and the one-process pipeline run the forward under
  `torch.autocast` in bfloat16 instead: the residual stream stays fp32 beside bf16 copies of each matmul's inputs.
- fp16: autocast in float16 plus a loss scaler: `torch.amp.GradScaler` in one process, `ShardedGradScaler`
  across processes (it all-reduces "found an overflow", so every rank skips the same step whatever it holds: a
  shard, a pipeline stage, a replica). An overflow is the scaler's business, not a fault: the scaler skips that
  update and lowers its scale, and the run goes on (step.py logs it as skipped by the scaler).

The template owns this instead of Accelerate (built with mixed_precision="no", except under DeepSpeed, whose engine
does both from its config): Accelerate's fp16 on CPU is silently fp32 and it has no answer for a sharded or
pipelined model, while the same few lines here run on every engine, on CPU and GPU alike, so CPU processes
rehearse fp16 too (slowly: CPU float16 matmuls are not fast).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    name: str  # no | bf16 | fp16: what the banner and summary.json report
    device_type: str  # cpu | cuda
    scaler: torch.amp.GradScaler | None = None  # fp16 only
    external: bool = False  # DeepSpeed casts and scales in its own engine: nothing to do here

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.external else DTYPES.get(self.name)

    def autocast(self, enabled: bool = True):
        """The forward's autocast (a no-op at fp32, under DeepSpeed, or for a module FSDP2 already casts)."""
        if self.dtype is None or not enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the fp16 loss scale, when there is one."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this precision (None at fp32): low-precision parameters for the
        all-gather and the compute, fp32 for the gradient reduce-scatter."""
        if self.dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def state_dict(self) -> dict | None:
        """The loss scaler's state (plain numbers) for checkpoints; None without a scaler."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if state and self.scaler is not None:
            self.scaler.load_state_dict(state)


def make_precision(name: str, device: torch.device, world_size: int, deepspeed: bool = False) -> Precision:
    """The run's precision; with fp16 a loss scaler that agrees across `world_size` processes."""
    if deepspeed or name not in DTYPES:
        return Precision(name, device.type, external=deepspeed)
    scaler = None
    if name == "fp16":
        if world_size > 1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device=device.type)  # found_inf all-reduced over every process
        else:
            scaler = torch.amp.GradScaler(device.type)
    return Precision(name, device.type, scaler)
