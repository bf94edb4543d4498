"""What a run prints: the start banner, the progress bar, the per-interval training line, each evaluation's line, and
less noise from third-party libraries.

The trainer prints one start banner, one line per log interval and one per evaluation, from the main
process only. Library warnings are shown once per node (the first process of each machine; the other
processes run the same code and would repeat them) and once per distinct message, not once per call site.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"  # None: not measured yet (no log or eval step so far)


def start_line(engine_name: str, world: int, device: Any, precision: str, config_path: str | None, out: Any, tracker: str) -> str:
    """The banner's first line: what launched the run, where, and where its outputs go."""
    return (
        f"[parallel_train] {engine_name} | world size {world} | device {device} | threads {torch.get_num_threads()} | "
        f"precision {precision} | config {config_path or 'defaults'} | output_dir {out} | tracker {tracker}"
    )


def progress_bar(max_steps: int, start_step: int, main_process: bool) -> tqdm:
    """The bar of optimizer steps, on the main process (off when stderr is not a terminal: the plain lines remain)."""
    return tqdm(total=max_steps, initial=start_step, disable=None if main_process else True, dynamic_ncols=True, desc="train")


def bar_fields(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's loss and speed, from a train record (tokens/s, or samples/s for a task judged per sample)."""
    if "samples_per_sec" in record:
        return {"loss": fmt(record["loss"]), "samples_s": f"{record['samples_per_sec']:,.0f}"}
    return {"loss": fmt(record["loss"]), "tok_s": f"{record['tokens_per_sec']:,.0f}"}


def eval_lines(step: int, train_loss: float | None, val: dict[str, float | None]) -> list[str]:
    """An evaluation's line (`val`: "loss" first, then each metric), and a notice when nothing was measured."""
    others = "".join(f", val {name} {fmt(value)}" for name, value in val.items() if name != "loss")
    lines = [f"step {step}: train loss {fmt(train_loss)}, val loss {fmt(val['loss'])}{others}"]
    if val["loss"] is None:  # eval_metrics.py: a ratio over nothing is not measured
        lines.append(f"notice: step {step}: the validation batches hold no token to learn; val metrics are null (not measured)")
    return lines


def engine_lines(engine: Any, train: Any, global_batch: int, params: dict[str, int]) -> list[str]:
    """The start banner's lines about the engine: what the processes do, the global batch, what is compiled, and with
    LoRA what trains."""
    lines = [
        f"[parallel_train] engine: {engine.name} | global batch {train.batch_size} x {engine.dp_size} data-parallel ranks x "
        f"{train.gradient_accumulation_steps} accumulation = {global_batch} samples per optimizer step"
    ]
    if engine.compiled:
        lines.append(f"[parallel_train] compiled: {engine.compiled}")
    if getattr(engine, "notice", None):  # e.g. logits gathered whole for a loss loss parallel cannot serve (parallel/sharding.py)
        lines.append(engine.notice)
    trainable, total = params["trainable_params"], params["total_params"]
    if trainable < total:  # LoRA: the optimizer holds the adapters only
        lines.append(f"[parallel_train] trainable: {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%); the rest frozen")
    active = params.get("active_params", total)
    if active < total:  # a mixture of experts: what MFU counts (6 FLOPs per active parameter per token, plus attention)
        lines.append(
            f"[parallel_train] mixture of experts: {active:,} of {total:,} parameters active per token ({100 * active / total:.1f}%: a token "
            "runs only the routed experts it is sent to); MFU counts these"
        )
    return lines


def train_line(record: dict[str, Any], max_steps: int) -> str:
    """`step 10/2000 | loss 2.3456 | lr 1.00e-03 | 12,345 tok/s | 70.1 ms/step | data 2% [| mfu 31.0%]` (samples/s for a
    task judged per sample)."""
    line = (
        f"step {record['step']}/{max_steps} | loss {'n/a' if record['loss'] is None else format(record['loss'], '.4f')} | lr {record['lr']:.2e} | "
        f"{throughput(record)} | {record['step_time_s'] * 1000:.1f} ms/step | "
        f"data {record['data_time_frac']:.0%}"
    )
    if record.get("mfu") is not None:
        line += f" | mfu {record['mfu']:.1%}"
    return line


def throughput(record: dict[str, Any]) -> str:
    """`12,345 tok/s` (tokens that are not padding) or `456 samples/s`: the task's units (core/task.py)."""
    if "samples_per_sec" in record:
        return f"{record['samples_per_sec']:,.1f} samples/s"
    return f"{record['tokens_per_sec']:,.0f} tok/s"


def quiet_third_party() -> None:
    """Show each distinct library warning once per node, not once per process, call site or step.

    Python's default repeats a warning for every module and line that triggers it, in every process.
    Set PYTHONWARNINGS (e.g. `PYTHONWARNINGS=default`) to see them all: an explicit setting wins.
    """
    # datasets' readers (json, csv, parquet, ...) log a malformed file themselves before raising; the one-line error
    # names the file instead (tests/test_generated_task_data.py's binary files, through train.py).
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    if sys.warnoptions:
        return
    action = "once" if os.environ.get("LOCAL_RANK", "0") == "0" else "ignore"
    for category in (UserWarning, FutureWarning, RuntimeWarning):  # the kinds Python shows by default
        warnings.filterwarnings(action, category=category)
