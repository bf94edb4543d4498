"""What a run says about itself: metrics.jsonl's train record of each log interval (`train_record`), and summary.json
at the end (losses, metrics, speed, memory, what it resumed from, the config a later launch into the same folder is
compared with: run/finished.py), written with the loss picture (`write_summary`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from parallel_train.checkpoint.writer import write_file, write_with
from parallel_train.core.json_text import json_text
from parallel_train.observe.messages import fmt
from parallel_train.observe.perf import mfu, peak_memory_mb
from parallel_train.observe.plots import PICTURE, plot_runs
from parallel_train.run.finished import summary_config


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """summary.json's trainable_params and total_params (with LoRA the adapters against the whole model); on the meta
    device when the model starts there: shapes only, and a tied weight counted once. A mixture of experts adds
    active_params: each token runs top-k of its routed experts (models/hf_moe.py)."""
    params = list(model.parameters())
    counts = {"trainable_params": sum(p.numel() for p in params if p.requires_grad), "total_params": sum(p.numel() for p in params)}
    if hasattr(model, "active_params"):
        counts["active_params"] = model.active_params()
    return counts


def train_record(t: Any, loss: float | None, lr: float, units: int) -> dict[str, Any]:
    """metrics.jsonl's train record of the log interval just ended, from the Trainer `t`: `loss` (None: a skipped step
    had nothing to learn), the rate `lr` the step ran at, and `units` (every rank's count summed, in the task's units:
    core/task.py)."""
    done, interval = t.state.step, t.cfg.train.log_interval
    rate, elapsed = t.speed.interval(warm=done > t.start_step + interval, units=units)  # the first holds warm-up
    record = {
        "kind": "train",
        "step": done,
        "loss": loss,
        "lr": lr,
        f"{t.task.units}_per_sec": rate,  # tokens_per_sec (not padding) or samples_per_sec
        "step_time_s": elapsed / (min(interval, done - t.start_step) or 1),
        "data_time_frac": min(1.0, t.batches.seconds / elapsed),
        "mfu": mfu(t.flops_per_token, rate, t.peak, t.accelerator.num_processes),
    }
    balance = getattr(t.engine, "balance", None)  # MoE layers (parallel/router_balance.py): aux_loss, expert_load
    if balance is not None:
        record.update(balance.report())
    if t.precision.scaler is not None:  # fp16: updates the loss scaler skipped on an overflow, so far
        record["skipped_by_scaler"] = t.stepper.skipped_by_scaler
    if not t.data.all_targets_count:  # samples with ignored targets: steps with nothing to learn, so far
        record["skipped_empty_steps"] = t.stepper.skipped_empty
    return record


def run_summary(t: Any) -> dict[str, Any]:
    """summary.json's fields from a finished Trainer `t` (the engine adds its own)."""
    accelerator, state, rate = t.accelerator, t.state, t.speed.steady_rate
    return {
        "steps": t.cfg.train.max_steps,
        "final_train_loss": state.final_train_loss,
        "final_val_loss": state.final_val_loss,
        "best_val_loss": state.best_val_loss,
        "final_val_metrics": state.final_val_metrics,
        "world_size": accelerator.num_processes,
        **t.params,  # trainable_params, total_params: with LoRA the adapters against the whole model
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": t.precision.name,
        "skipped_by_scaler_steps": t.stepper.skipped_by_scaler,
        "skipped_empty_steps": t.stepper.skipped_empty,  # no token to learn on any rank (step.py)
        f"{t.task.units}_per_sec": rate,  # tokens_per_sec (not padding) or samples_per_sec (core/task.py)
        "mfu": mfu(t.flops_per_token, rate, t.peak, accelerator.num_processes) if rate else None,
        "wall_time_s": time.perf_counter() - t.t_start,
        "time_to_first_step_s": t.first_step_s,
        "resumed_from": str(t.resume_from) if t.resume_from else None,
        "config": summary_config(t.cfg),  # what a later launch into this folder compares itself with (run/finished.py)
        "checkpoint_blocking_s": t.saver.blocking_s,  # the loop's time in checkpoint saves (checkpoint.async: the copy)
        "checkpoint_drain_s": t.saver.drain_s,  # the wait for the last background write, after the loop
        **peak_memory_mb(t.device),
        **{f"{k}_after_start": v for k, v in t.start_memory.items()},
        **{f"{k}_at_first_step": v for k, v in getattr(t, "first_step_memory", {}).items()},
    }


def write_summary(out: Path, summary: dict[str, Any], say: Callable[[str], None]) -> None:
    """summary.json (no NaN or Infinity: null) and the loss picture, in output_dir (the main process); then the run's
    last line."""
    write_file(out / "summary.json", json_text(summary, indent=1))
    say(f"[parallel_train] loss curves: {write_with(out / PICTURE, lambda path: plot_runs([out], path))}")
    say(
        f"[parallel_train] done: {summary['steps']} steps, val loss {fmt(summary['final_val_loss'])}, "
        f"{summary['wall_time_s']:.1f} s; outputs in {out}"
    )
