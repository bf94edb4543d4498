"""What one training forward leaves alive for backward, per part of the model: measured on fake tensors.

Run the forward and the loss of a micro-batch under FakeTensorMode (shapes and sizes, nothing allocated) with a
TorchDispatchMode that notes every storage an op creates and the part of the model that was running; when the loss
is computed, the storages still alive are what backward will read (or what holds them: a view, the loss). This
follows the code whatever it does, not a model of it:
- activation checkpointing in any mode: `full` keeps only each block's input (torch's checkpoint frees the rest),
  `selective` op keeps the outputs its policy MUST_SAVEs (in checkpoint's own cache), every-N-th keeps those blocks'
  inputs and the others' whole; models/activation_checkpoint.py decides, as in a run;
- precision: under autocast the residual stream stays fp32 and the bf16 copies are extra; under FSDP2's
  MixedPrecisionPolicy the blocks compute in bf16 from bf16 parameters, so their activations are bf16;
- FSDP2's gathered weights are freed after each block's forward (their storages resized to 0: counted as 0);
- tensor and sequence parallelism: a DTensor's local slice is what this rank holds.
Parameters (this rank's shards and views of them) are not activations and are left out.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_train.losses import logits_of, loss_fn
from parallel_train.parallel.parts import counted_units, fsdp_units


@dataclass
class PartBytes:
    """One micro-batch's activation bytes by part of the model (its units: `model.layers.3`, `lm_head`, `loss`)."""

    kept: dict[str, int] = field(default_factory=dict)  # alive after the forward: held until the part's backward
    inputs: dict[str, int] = field(default_factory=dict)  # bytes of each part's input
    largest: dict[str, int] = field(default_factory=dict)  # the largest single tensor each part keeps
    blocks: set[str] = field(default_factory=set)  # the parts that are blocks (what checkpointing can recompute)
    attention: int = 0  # the largest attention's q, k, v and output (what context parallel's all-to-all exchanges)


class _Created(TorchDispatchMode):
    """Every storage an op creates, with the part of the model that was running then."""

    def __init__(self, current: list[str]):
        super().__init__()
        self.current = current
        self.made: dict[int, tuple[str, weakref.ref]] = {}
        self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "scaled_dot_product" in func.__name__:  # SDPA's q, k, v and its output (the first of what it returns)
            first = out[0] if isinstance(out, tuple | list) else out
            self.attention = max(self.attention, sum(_local_bytes(t) for t in (*args[:3], first)))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor: its local slice
                old = self.made.get(storage._cdata)
                if old is None or old[1]() is None:  # an address reused after a free is a new storage
                    self.made[storage._cdata] = (self.current[0], weakref.ref(storage))
        return out


def _local_bytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor (sequence parallel's input): this rank's slice
    return local.numel() * local.element_size()


def _storage_ids(model: nn.Module) -> set[int]:
    ids = set()
    for q in model.parameters():
        ids.add(q.untyped_storage()._cdata)
        if hasattr(q, "to_local"):
            ids.add(q.to_local().untyped_storage()._cdata)
    return ids


def block_names(model: nn.Module) -> set[str]:
    """The parts that are blocks (FSDP2's units: what activation checkpointing wraps). Read before `fully_shard`,
    which renames their classes."""
    blocks = {id(m) for m in fsdp_units(model)}
    return {name for name, m in counted_units(model).items() if id(m) in blocks}


def kept_per_part(
    model: nn.Module,
    forward,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast_dtype,
    loss_context,
    blocks: set[str],
    keep_output: bool = False,
    stages: tuple[tuple[nn.Module, str], ...] = (),
    units: dict[str, nn.Module] | None = None,
) -> PartBytes:
    """What one training forward (`forward(x)`: the model, or its pipeline stages in turn) and the loss keep alive, by
    part of `model`. Run on fake tensors. `keep_output`: the model's output (the logits) is held until backward whether
    or not the loss saved it, as torch's PipelineStage holds its last stage's output per micro-batch (its fwd_cache).
    `stages`: (a pipeline stage's view, its first part): what a stage makes before its first part runs (a decoder's
    masks and rotary tables for its layers) is that part's, not the previous stage's. `units`: the parts
    (counted_units), read before `fully_shard`, which renames the classes a model may find its blocks by."""
    units = units or counted_units(model)
    current, inputs = ["loss"], {}

    def enter(name):
        def hook(module, args):
            current[0] = name
            inputs[name] = sum(_local_bytes(a) for a in args if torch.is_tensor(a))

        return hook

    handles = [module.register_forward_pre_hook(enter(name)) for name, module in (*units.items(), *((n, m) for m, n in stages))]
    amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    created = _Created(current)
    try:
        with loss_context, amp, created:
            out = forward(x)
            current[0] = "loss"
            loss = loss_fn(logits_of(out), y)
            if not keep_output:
                del out  # a run keeps the logits only where the loss saved them
    finally:
        for h in handles:
            h.remove()
    gc.collect()
    params = _storage_ids(model)
    result = PartBytes(inputs=inputs, blocks=blocks, attention=created.attention)
    for key, (part, ref) in created.made.items():
        storage = ref()
        if storage is None or key in params:
            continue
        n = storage.nbytes()
        result.kept[part] = result.kept.get(part, 0) + n
        result.largest[part] = max(result.largest.get(part, 0), n)
    del loss
    return result  # `out`, where kept, is freed here: it was counted while alive
