"""train.py with every host read of each step counted (tests/test_host_sync.py; item 9 of issue 27).

    SYNC_PROBE_OUT=DIR python tests/sync_probe.py KEY=VALUE ...     (forked warm: tests/helpers.py's WarmCmd)

A TorchFunctionMode sees every torch call made from Python during a step (the template's, accelerate's and torch's
own Python code) and counts the ones that make the host wait for the device on a GPU:
- a value read: `item`, `tolist`, `cpu`, a tensor's `bool`/`int`/`float`/`index`; anywhere but the data loader
  (parallel_train/data/), which reads host tensors only, before a batch moves to the device;
- a tensor made from Python numbers on a device (`torch.tensor(..., device=...)`): a copy from host memory;
- a blocking `to(DEVICE)` in the template's own code (a host tensor sent to the device, or the other way). torch's
  own same-device moves (clip_grad's norms `.to(first_device)`) copy nothing and are left out.
On a CPU run the device is the host itself: each such call is counted as it would cost a sync on a GPU. Each rank
writes DIR/rank<R>.json: {step: ["call at file:line", ...]} for every step, its agreement with the other ranks (the
guard's end_step) included.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from parallel_train import guards, trainer  # noqa: E402

READS = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__"}  # a value the host waits for
FROM_HOST = {"tensor", "as_tensor"}  # a tensor made from Python numbers: a blocking copy when a device is named


def blocking_copy(name: str, args: tuple, kwargs: dict) -> bool:
    """`tensor.to(DEVICE)` without non_blocking=True (a dtype alone moves nothing)."""
    if name != "to" or kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:2])


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        caller = sys._getframe(1)  # where the call was made: named in the test's message
        where = Path(caller.f_code.co_filename)
        ours = "parallel_train" in where.parts
        if (
            (name in READS and not (ours and "data" in where.parts))
            or (name in FROM_HOST and kwargs.get("device") is not None)
            or (ours and blocking_copy(name, args, kwargs))
        ):
            self.calls.append(f"{name} at {'/'.join(where.parts[-2:])}:{caller.f_lineno}")
        return func(*args, **kwargs)


RECORD: dict[int, list[str]] = {}


def counted(method, step_of):
    def wrapper(self, *args, **kwargs):
        with HostReads() as mode:
            result = method(self, *args, **kwargs)
        RECORD.setdefault(step_of(self, args, result), []).extend(mode.calls)
        rank = int(os.environ.get("RANK", "0"))
        Path(os.environ["SYNC_PROBE_OUT"], f"rank{rank}.json").write_text(json.dumps(RECORD))
        return result

    return wrapper


trainer.Trainer.train_step = counted(trainer.Trainer.train_step, lambda self, args, result: result[1])
guards.RunGuard.end_step = counted(guards.RunGuard.end_step, lambda self, args, result: args[0])

sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
