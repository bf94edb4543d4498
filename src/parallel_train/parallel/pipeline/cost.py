"""Measured cost of each unit of a model, for `parallel.split=time` (balance stages by time, not parameters).

Parameter counts are a poor guide when parameters and compute part ways: GPT-2's token embedding holds a
third of the weights and costs almost nothing to run, while its output layer (the same size) is the most
expensive matmul of the model. `split=time` times every part of the model on one batch, forward and backward,
ONE PART AT A TIME: the part (a unit, or a group of units that run together, split.py's bundles) gets memory on
the device (`init.fill`: the run's own initialisation), runs a few forward and backward passes on the activation
the part before it produced, and gives its memory back (`init.release`), so the probe never holds more of the
model than its largest part, the way a 70B model has to be measured. The first unit of a bundle carries the
bundle's time.

Every rank measures, then the times are summed over ranks (one all-reduce) so that all ranks cut the model at
the same places.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from parallel_train.core.collectives import all_reduce_small
from parallel_train.data.batch import parts
from parallel_train.losses import loss_fn
from parallel_train.parallel.parts import model_units
from parallel_train.parallel.pipeline.split import bundles, stage_module

WARMUP, REPEATS = 1, 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor | None], device: torch.device) -> tuple[float, torch.Tensor | None]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def unit_times(model: nn.Module, units: list[str], x: torch.Tensor, y: torch.Tensor, device: torch.device, init) -> list[float]:
    """Median seconds of forward + backward of each unit (in `units`' forward order) on one batch, one bundle of
    units in memory at a time (see the module docstring)."""
    seconds = dict.fromkeys(units, 0.0)
    h: torch.Tensor = x.to(device)
    parts = bundles(model, model_units(model))
    for i, part in enumerate(parts):
        view = stage_module(model, part).train()
        init.fill(view, device)
        samples = []
        for rep in range(WARMUP + REPEATS):
            inp = h.detach().requires_grad_(h.is_floating_point())  # the gradient of the part's input is its work too
            forward, out = _timed(lambda: view(inp), device)  # noqa: B023 (called at once)
            last = i == len(parts) - 1
            target = loss_fn(out, y.to(device)) if last else out
            backward, _ = _timed(lambda: target.backward(None if last else torch.ones_like(out)), device)  # noqa: B023
            if rep >= WARMUP:
                samples.append(forward + backward)
        h = out.detach()
        seconds[part[0]] = statistics.median(samples)
        init.release(view)
    return [seconds[name] for name in units]


def agreed_unit_times(model: nn.Module, units: list[str], x: torch.Tensor, y: torch.Tensor, device: torch.device, init) -> list[float]:
    """unit_times summed over all ranks (a collective when a process group runs): every rank gets the same list."""
    times = torch.tensor(unit_times(model, units, x, y, device, init), dtype=torch.float64)
    return all_reduce_small(times, torch.distributed.ReduceOp.SUM, device).cpu().tolist()


def measure_units(model: nn.Module, probe: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device, init):
    """For plan_stages: a function of the unit names that times them on `probe()` (one training batch of
    validation samples; called only when parallel.split=time asks for it), filling each part with `init`
    (parallel/model_init.py). The times it measured stay in its `seconds` (for the banner)."""

    def measure(units: list[str]) -> list[float]:
        x, y, _ = parts(probe())  # a packed batch's positions, a dict's other inputs left out: the cost of a unit
        times = agreed_unit_times(model, units, x, y, device, init)
        measure.seconds = dict(zip(units, times, strict=True))
        return times

    measure.seconds = None
    return measure
