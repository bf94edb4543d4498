"""Speed settings, the peak FLOP/s of known accelerators (for model FLOPs utilisation, MFU), the throughput meter
(tokens/s or samples/s), the data wait and the peak memory."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from parallel_train.config.sections import TrainConfig
from parallel_train.errors import UserError

# Dense peak TFLOP/s (no sparsity) from the vendors' data sheets, per GPU (SXM parts).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def configure_backends(cfg: TrainConfig, device: torch.device, shards_parameters: bool = False) -> None:
    """Host allocator (below; `shards_parameters`: FSDP2, HSDP or tensor parallel on this launch); TF32 tensor cores
    for fp32 matmuls/convolutions on GPU (train.tf32): about 8x an fp32 matmul on A100/H100 at a 10-bit mantissa,
    which training tolerates."""
    set_host_allocator(shards_parameters)
    if device.type == "cuda":
        precision = "tf32" if cfg.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


# glibc's mallopt parameters (malloc.h), and the variables by which a user sets them (then left alone)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
TRIM_ONLY_PAST = 1 << 30  # free bytes at the top of the heap before glibc hands them back (every layout)
MMAP_FROM = {False: 32 << 20, True: 1 << 20}  # blocks this big or bigger get their own mmap, by shards_parameters


def host_allocator_thresholds(shards_parameters: bool) -> tuple[int, int]:
    """glibc's (mmap threshold, trim threshold) for a layout: keep freed memory for the next step, except the
    blocks that sharding exists to free.

    A training step frees and allocates the same few MB of activations every step. By default glibc trims
    the heap once a little of its top is free and serves large blocks with fresh mmaps, so every step
    page-faults that memory in again: about 1,000 faults and 1.5-3 ms of kernel time per step on the CPU
    baseline (5-10% of the step; docs/BENCHMARKS.md "Template overhead"). Fixed thresholds (blocks up to 32 MiB
    from the heap, trim only past 1 GiB free) remove that; one process and DDP keep them.

    Where parameters are sharded (FSDP2, HSDP, tensor parallel) the same 32 MiB hides what sharding saves: a step
    makes full-size blocks and frees them (a block's unsharded gradients, 4-16 MiB each in a 1024-wide GPT), the
    heap keeps them, and rank 0 of a 302M-parameter GPT at its first step stood 24% above its share of the state on
    2 FSDP2 processes and 44% on 4 (3,423 MB against 2,758; 2,310 against 1,604). glibc's own dynamic threshold
    keeps them too (it rises to 32 MiB once such a block is freed). There blocks from 1 MiB up get their own mmap,
    unmapped when freed: 2,768 MB on 2 processes, 1,614 on 4 (under 1% over; 128 KiB gave 2,765, 4 MiB 2,779);
    tensor parallel over 2, 2,832 MB against 3,049 with 32 MiB. A low trim threshold made no difference, so it
    stays, and smaller blocks stay on the heap: a step does not fault its small activations in again (the default
    job's 1.5 MiB MLP activations are faulted in again under FSDP2: about 700 faults per rank per step). Pipelines
    keep 32 MiB (not measured: each stage holds its layers whole, as one process does).
    """
    return MMAP_FROM[shards_parameters], TRIM_ONLY_PAST


def set_host_allocator(shards_parameters: bool = False) -> tuple[int, int] | None:
    """Give glibc the thresholds above; the ones set, or None where the C library is not glibc or where the user
    set glibc's own thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES=glibc.malloc...):
    theirs stand. Called before the model is built, from the config and the world size, so every rank decides
    alike and the big blocks are placed by the thresholds from the first."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(k in os.environ for k in USER_MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mmap_threshold, trim_threshold = host_allocator_thresholds(shards_parameters)
    if mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold):
        return mmap_threshold, trim_threshold
    return None


SYNC_DEBUG = "PARALLEL_TRAIN_SYNC_DEBUG"  # warn | error: torch.cuda.set_sync_debug_mode around the steady steps


def sync_debug_mode(device: torch.device) -> tuple[str | None, str | None]:
    """(the mode, a notice) from PARALLEL_TRAIN_SYNC_DEBUG=warn|error: torch.cuda.set_sync_debug_mode around every step
    of a launch but its first (lazy starts, a pipeline's shape exchange), so that a host-device sync creeping into the
    step warns or stops the run (step.py: a step that neither logs nor agrees never waits for the device). The
    GPU benchmark scripts set error. CUDA only: on another device the switch is named and left off. Steps that
    sync by design: train.max_skipped_steps > 0 (the verdict before every update), fp16 on data with ignored targets."""
    value = os.environ.get(SYNC_DEBUG, "")
    if not value:
        return None, None
    if value not in ("warn", "error"):
        raise UserError(
            f"{SYNC_DEBUG}={value!r}: expected warn or error (torch.cuda.set_sync_debug_mode around the training steps), or leave it unset"
        )
    if device.type != "cuda":
        return None, f"notice: {SYNC_DEBUG}={value} checks CUDA devices only; this run is on {device.type}: not checked"
    return value, None


@contextmanager
def sync_checked(mode: str | None):
    """torch.cuda.set_sync_debug_mode(mode) inside, back to default after (nothing when mode is None)."""
    if mode is None:
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def peak_flops(device: torch.device, precision: str, cfg: TrainConfig) -> float | None:
    """FLOP/s of one device at this precision: train.peak_tflops, else the PEAK_TFLOPS env var, else the
    table above for a known GPU; None when unknown (e.g. a CPU without train.peak_tflops)."""
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops * 1e12
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = "bf16" if precision in ("bf16", "fp16") else "tf32" if cfg.tf32 else "fp32"
    for gpu, peaks in PEAK_TFLOPS.items():
        if gpu in name:
            return peaks[kind] * 1e12
    return None


def mfu(flops_per_token: int | None, tokens_per_sec: float, peak: float | None, world_size: int) -> float | None:
    """Share of the devices' peak FLOP/s the model's training FLOPs used (None when a term is unknown)."""
    if not flops_per_token or not peak or not tokens_per_sec:
        return None
    return flops_per_token * tokens_per_sec / (peak * world_size)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so interpreter start-up and imports count too."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class Throughput:
    """Throughput in the task's units (tokens or samples: core/task.py) over each log interval, not counting the pauses
    for evaluation and checkpoints; the steady rate over the whole run leaves out the first interval (compilation,
    allocator and cache warm-up). `add` takes this rank's count; `interval` the count over every rank, when given."""

    def __init__(self) -> None:
        self.t_last, self.paused, self.pending = time.perf_counter(), 0.0, 0
        self.steady_units, self.steady_time = 0, 0.0

    def add(self, units: int) -> None:
        self.pending += units

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def interval(self, warm: bool, units: int | None = None) -> tuple[float, float]:
        """(units/s, seconds) of the interval since the last call; `warm` intervals count towards the steady rate.
        `units`: the interval's count over every rank (default: what `add` was given)."""
        now = time.perf_counter()
        elapsed = max(now - self.t_last - self.paused, 1e-9)
        units = self.pending if units is None else units
        rate = units / elapsed
        if warm:
            self.steady_units, self.steady_time = self.steady_units + units, self.steady_time + elapsed
        self.t_last, self.paused, self.pending = now, 0.0, 0
        return rate, elapsed

    @property
    def steady_rate(self) -> float | None:
        return self.steady_units / self.steady_time if self.steady_time else None


class TimedIterator:
    """Wraps the batch iterator and adds up the time spent waiting for data."""

    def __init__(self, iterator):
        self.iterator, self.seconds = iterator, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        item = next(self.iterator)
        self.seconds += time.perf_counter() - t
        return item


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far: the device's allocated and reserved bytes on a GPU, the host's RSS on a CPU."""
    if device.type == "cuda":
        return {
            "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_memory_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # host RSS (KiB on Linux)
