#!/usr/bin/env python3
"""train.py with one measurement added: each rank's peak resident memory over its second optimizer step.

    RANK_PEAK_DIR=DIR python scripts/bench/rank_peak.py KEYS...               one process
    RANK_PEAK_DIR=DIR torchrun --nproc-per-node N scripts/bench/rank_peak.py KEYS...

Run by scripts/bench/memory_matrix.py (and its test), never by a user. Each rank writes DIR/rank<R>.json:
{"peak": bytes} = the kernel's high-water mark of the process's resident memory (VmHWM), reset when step 1 ends
(`/proc/self/clear_refs` 5) and read when step 2 ends: the peak of a step with the optimizer's state in place,
which is what the estimator predicts; and {"start": bytes}, the resident memory when step 1 ended (weights and
optimizer state, no gradients): peak - start is what the step itself added at its peak (activations and scratch). glibc is told to hand freed memory back at once (as scripts/bench/start.py's
RETURN_FREED does, but with mallopt, which also holds in a process forked from a warm one), so the peak is what
was live and not what the allocator kept. The run itself is train.py's, unchanged: its engine, step and model.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

RETURN_FREED = 128 << 10  # glibc: blocks from 128 KiB up get their own mmap; the heap is trimmed past 128 KiB free
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def status_bytes(field: str) -> int:
    """A /proc/self/status figure (kB) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def return_freed_memory() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, RETURN_FREED)
    libc.mallopt(M_TRIM_THRESHOLD, RETURN_FREED)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(RETURN_FREED)  # the template then leaves glibc as set here (observe/perf.py)


def measure_second_step(out: Path) -> None:
    from parallel_train import trainer

    original, start = trainer.Trainer.train_step, [0]

    def train_step(self):
        result, step = original(self)
        if step == 1:  # the optimizer's state exists, the gradients are freed: measure the next step alone
            Path("/proc/self/clear_refs").write_text("5")
            start[0] = status_bytes("VmRSS")  # what stands before the step: the step's own peak is above it
        elif step == 2:
            rank = int(os.environ.get("RANK", "0"))
            peaks = {"peak": status_bytes("VmHWM"), "rss": status_bytes("VmRSS"), "start": start[0]}
            (out / f"rank{rank}.json").write_text(json.dumps(peaks))
        return result, step

    trainer.Trainer.train_step = train_step


def main() -> None:
    out = Path(os.environ["RANK_PEAK_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    return_freed_memory()
    measure_second_step(out)
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
