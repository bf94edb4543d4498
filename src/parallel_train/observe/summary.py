"""summary.json: what a finished run says about itself (losses, metrics, speed, memory, what it resumed from, the
config a later launch into the same folder is compared with: run/finished.py)."""

from __future__ import annotations

import time
from typing import Any

from parallel_train.observe.perf import mfu, peak_memory_mb
from parallel_train.run.finished import summary_config


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
