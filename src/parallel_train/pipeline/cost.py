"""Measured cost of each unit of a model, for `parallel.split=time` (balance stages by time, not parameters).

Parameter counts are a poor guide when parameters and compute part ways: GPT-2's token embedding holds a
third of the weights and costs almost nothing to run, while its output layer (the same size) is the most
expensive matmul of the model. `split=time` runs a few training steps of the whole model on one batch and
times every unit, forward and backward:
- forward: the time from the end of the previous unit's forward to the end of this unit's (forward hooks);
- backward: the time from the gradient of this unit's output arriving to the gradient of the previous
  unit's output arriving (tensor hooks), the first unit's ending with backward().
What `forward` does between units (adding the position embedding) counts for the unit after it.

Every rank measures, then the times are summed over ranks (one all-reduce) so that all ranks cut the model at
the same places. The whole model runs on `device` for this, so it must fit there once: for a model that
does not, name the stages yourself (`parallel.split='...|...'`) or use `auto`.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from parallel_train.guards import all_reduce_small
from parallel_train.losses import loss_fn

WARMUP, REPEATS = 1, 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def unit_times(model: nn.Module, units: list[str], x: torch.Tensor, y: torch.Tensor, device: torch.device) -> list[float]:
    """Median seconds of forward + backward of each unit (in `units`' forward order) on one batch."""
    twin = copy.deepcopy(model).to(device).train()  # the real model keeps its weights and its RNG use untouched
    modules = dict(twin.named_modules())
    x, y = x.to(device), y.to(device)
    fwd_end: dict[str, float] = {}
    bwd_start: dict[str, float] = {}

    def after_forward(name: str):
        def hook(module, args, output):
            _sync(device)
            fwd_end[name] = time.perf_counter()
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda grad: _mark_backward(name))
            return None

        return hook

    def _mark_backward(name: str) -> None:
        _sync(device)
        bwd_start[name] = time.perf_counter()

    handles = [modules[name].register_forward_hook(after_forward(name)) for name in units]
    samples: list[list[float]] = []
    try:
        for i in range(WARMUP + REPEATS):
            fwd_end.clear(), bwd_start.clear()
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(twin(x), y)
            loss.backward()
            _sync(device)
            t_end = time.perf_counter()
            twin.zero_grad(set_to_none=True)
            if i < WARMUP:
                continue
            costs, prev_fwd = [], t0
            for k, name in enumerate(units):
                forward = fwd_end.get(name, prev_fwd) - prev_fwd
                prev_fwd = fwd_end.get(name, prev_fwd)
                # Backward of unit k runs from its output's gradient to the gradient of the output before it.
                before = next((bwd_start[u] for u in reversed(units[:k]) if u in bwd_start), t_end)
                backward = before - bwd_start[name] if name in bwd_start else 0.0
                costs.append(max(forward, 0.0) + max(backward, 0.0))
            samples.append(costs)
    finally:
        for h in handles:
            h.remove()
        del twin
    return [statistics.median(column) for column in zip(*samples, strict=True)]


def agreed_unit_times(model: nn.Module, units: list[str], x: torch.Tensor, y: torch.Tensor, device: torch.device) -> list[float]:
    """unit_times summed over all ranks (a collective when a process group runs): every rank gets the same list."""
    times = torch.tensor(unit_times(model, units, x, y, device), dtype=torch.float64)
    return all_reduce_small(times, torch.distributed.ReduceOp.SUM, device).cpu().tolist()


def measure_units(model: nn.Module, val_loader, device: torch.device):
    """For plan_stages: a function of the unit names that times them on the first validation batch (called only
    when parallel.split=time asks for it). The times it measured stay in its `seconds` (for the banner)."""

    def measure(units: list[str]) -> list[float]:
        x, y = next(iter(val_loader))
        times = agreed_unit_times(model, units, x, y, device)
        measure.seconds = dict(zip(units, times, strict=True))
        return times

    measure.seconds = None
    return measure
