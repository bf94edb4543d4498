"""The training loop, top to bottom: set up, train, evaluate, checkpoint, write the results.

Parallelism comes from the Accelerator (DDP over however many processes the launcher started) and from
the data sharding in data.py; nothing here depends on the topology.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from parallel_train import checkpoint, faults
from parallel_train.accelerator_setup import make_accelerator
from parallel_train.config import Config, save_config
from parallel_train.data import train_loader, val_loader
from parallel_train.data_sources import load_data
from parallel_train.errors import UserError, is_first_process
from parallel_train.guards import RunGuard, stop_message
from parallel_train.messages import train_line
from parallel_train.models import build_model
from parallel_train.optim import build_optimizer, build_scheduler
from parallel_train.perf import configure_backends, mfu, peak_flops, process_age_s
from parallel_train.plots import PICTURE, plot_runs
from parallel_train.tokenization import load_vocab
from parallel_train.topology import build_engine, describe
from parallel_train.tracking import MetricsLog, finish_trackers, init_trackers, new_run_id, prepare_tracker_env
from parallel_train.weights_export import export

RUN_FILES = ("metrics.jsonl", "summary.json", "model.safetensors")


def say(message: str) -> None:
    """One line from the first process (before the Accelerator exists too)."""
    if is_first_process():
        tqdm.write(message)


def check_output_dir(cfg: Config) -> Path:
    """Refuse an output_dir that is a file, not writable, or holds a run we would overwrite."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: {cfg.output_dir!r} is a file; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{time.monotonic_ns()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UserError(f"output_dir: {cfg.output_dir!r} is not writable ({e.strerror})") from None
    if cfg.resume == "none" and any((out / f).exists() for f in RUN_FILES):
        raise UserError(f"output_dir: {cfg.output_dir!r} already holds a run; continue it with resume=auto or choose a new output_dir")
    return out


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
    if device.type == "cuda":
        return {
            "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_memory_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # host RSS (KiB on Linux)


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"  # None: not measured yet (no log or eval step so far)


def run(cfg: Config, config_path: str | None) -> int:
    t_start = time.perf_counter()
    out = check_output_dir(cfg)
    ckpt_root = out / "checkpoints"
    resume_from = checkpoint.resolve_resume(cfg.resume, ckpt_root, warn=lambda m: say(f"warning: {m}"))
    tracker_word = prepare_tracker_env(cfg.tracker, out, say)

    accelerator = make_accelerator(cfg, say)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    configure_backends(cfg.train, device)
    A = cfg.train.gradient_accumulation_steps
    say(
        f"[parallel_train] {describe(accelerator)} | world size {world} | device {device} | "
        f"precision {accelerator.mixed_precision} | config {config_path or 'defaults'} | output_dir {out} | tracker {tracker_word}"
    )

    # ---- data (the vocab of a resumed run is reused, so token ids cannot shift)
    vocab = load_vocab(resume_from / "vocab.json") if resume_from and (resume_from / "vocab.json").exists() else None
    data = load_data(cfg, vocab)

    # ---- model, optimizer, schedule. Same seed on every rank: identical initial weights.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, data.vocab_size)
    optimizer = build_optimizer(model, cfg.train, fused=device.type == "cuda")
    scheduler = build_scheduler(optimizer, cfg.train)
    engine = build_engine(cfg, accelerator, model, optimizer, val_loader(data, cfg))
    say(
        f"[parallel_train] engine: {engine.name} | global batch {cfg.train.batch_size} x {engine.dp_size} data-parallel "
        f"ranks x {A} accumulation = {cfg.train.batch_size * engine.dp_size * A} samples per optimizer step"
    )
    torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank dropout masks

    state = {"best_val_loss": None, "final_val_loss": None, "final_train_loss": None, "run_id": new_run_id()}
    start_step = 0
    if resume_from is not None:
        state.update(checkpoint.load(resume_from, engine, scheduler))
        start_step = state.pop("step")
        say(f"[parallel_train] resumed from {resume_from} at step {start_step}")
        notice = checkpoint.topology_notice(state, world, cfg.train.batch_size * engine.dp_size * A)
        if notice:
            say(notice)
    state["global_batch"] = cfg.train.batch_size * engine.dp_size * A
    # guards.py: stop signals, non-finite loss/gradients, the stop step all ranks agree on
    guard = RunGuard(accelerator, cfg.train.max_skipped_steps, cfg.parallel.timeout_s, state.get("skipped_steps", 0))
    engine.update_allowed = guard.update_allowed
    faults.install(engine.model, lambda: guard.step)  # test-only; nothing unless PARALLEL_TRAIN_FAULT is set

    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    vocab_json = data.vocab.to_json() if data.vocab else None
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        if data.vocab is not None:
            (out / "vocab.json").write_text(vocab_json)
    metrics = MetricsLog(out / "metrics.jsonl", accelerator, cfg.tracker)
    metrics.truncate_after(start_step)
    init_trackers(accelerator, cfg.tracker, cfg.to_dict(), out, state["run_id"])

    batches = TimedIterator(iter(train_loader(data, cfg, engine.dp_size, engine.dp_rank, start_step, pin_memory=device.type == "cuda")))
    flops_per_token, peak = engine.flops_per_token(), peak_flops(device, accelerator.mixed_precision, cfg.train)

    c = cfg.checkpoint  # every rank writes its own part; with checkpoint.async in the background (checkpoint.py)
    saver = checkpoint.Checkpointer(ckpt_root, c.keep, c.keep_best, resume_from, background=c.async_, timeout_s=cfg.parallel.timeout_s)

    def save_checkpoint(step: int) -> None:
        state["skipped_steps"] = guard.skipped
        saver.save(engine, step, scheduler, state, config_yaml, vocab_json)

    def due(step: int, interval: int) -> bool:
        return step == cfg.train.max_steps or (interval > 0 and step % interval == 0)

    # ---- train
    pbar = tqdm(
        total=cfg.train.max_steps,
        initial=start_step,
        disable=None if accelerator.is_main_process else True,
        dynamic_ncols=True,
        desc="train",
    )
    first_step_s = None
    t_log, paused, steady_tokens, steady_time, tokens_since = time.perf_counter(), 0.0, 0, 0.0, 0
    guard.signals.install()  # from here on SIGTERM/SIGUSR1/SIGINT stop at an agreed step, with a checkpoint
    for step in range(start_step, cfg.train.max_steps):
        lr = optimizer.param_groups[0]["lr"]
        guard.begin_step(step + 1)
        loss, tokens = engine.train_step(batches)
        scheduler.step()
        done = step + 1
        faults.after_step(done)
        # All ranks agree on "stop signal?" and "non-finite?" (raises naming the step) before anything is logged or saved.
        stop = guard.end_step(done, loss, force=due(done, cfg.train.log_interval) or due(done, cfg.checkpoint.interval))
        tokens_since += tokens * engine.dp_size
        pbar.update(1)
        if first_step_s is None:  # from the process's start: imports and set-up count
            first_step_s = process_age_s() or time.perf_counter() - t_start

        if due(done, cfg.train.log_interval):
            # The only host-device sync of the step, and only on log steps: mean over ranks and micro-batches.
            train_loss = engine.mean_loss(loss).item()
            state["final_train_loss"] = train_loss
            now = time.perf_counter()
            elapsed = max(now - t_log - paused, 1e-9)
            tok_s = tokens_since / elapsed
            if done > start_step + cfg.train.log_interval:  # the first interval holds warm-up; leave it out
                steady_tokens, steady_time = steady_tokens + tokens_since, steady_time + elapsed
            steps_in_interval = min(cfg.train.log_interval, done - start_step) or 1
            record = {
                "kind": "train",
                "step": done,
                "loss": train_loss,
                "lr": lr,
                "tokens_per_sec": tok_s,
                "step_time_s": elapsed / steps_in_interval,
                "data_time_frac": min(1.0, batches.seconds / elapsed),
                "mfu": mfu(flops_per_token, tok_s, peak, world),
            }
            metrics.log(record)
            pbar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tok_s:,.0f}")
            say(train_line(record, cfg.train.max_steps))  # plain lines: the bar is off when stderr is not a terminal
            t_log, paused, tokens_since, batches.seconds = now, 0.0, 0, 0.0

        t_pause = time.perf_counter()
        if due(done, cfg.eval.interval):
            val = engine.evaluate()  # {"loss": ..., and every other metric of eval_metrics.py}
            val_loss = val["loss"]
            state["final_val_loss"], state["final_val_step"] = val_loss, done
            state["final_val_metrics"] = {f"val_{name}": value for name, value in val.items()}
            if state["best_val_loss"] is None or val_loss < state["best_val_loss"]:
                state["best_val_loss"] = val_loss
            metrics.log({"kind": "eval", "step": done, **state["final_val_metrics"]})
            others = "".join(f", val {name} {value:.4f}" for name, value in val.items() if name != "loss")
            say(f"step {done}: train loss {fmt(state['final_train_loss'])}, val loss {val_loss:.4f}{others}")
        if due(done, cfg.checkpoint.interval) or (stop and done < cfg.train.max_steps):
            save_checkpoint(done)
        paused += time.perf_counter() - t_pause
        if stop and done < cfg.train.max_steps:  # preempted: checkpoint written on all ranks; leave cleanly
            saver.finish()
            pbar.close()
            say(stop_message(stop, done, cfg.train.max_steps, ckpt_root / checkpoint.checkpoint_name(done)))
            finish_trackers(accelerator, cfg.tracker, out, state["run_id"], say)
            guard.signals.restore()
            return 0
    pbar.close()

    # ---- results
    if start_step >= cfg.train.max_steps:
        say(f"[parallel_train] the checkpoint is already at train.max_steps={cfg.train.max_steps}; nothing to train")
    engine_summary = engine.finish(out)  # a collective: e.g. the pipeline timeline
    saver.finish()  # the last checkpoint is on disk: the final weights are its export (one tensor at a time)
    final = ckpt_root / checkpoint.checkpoint_name(cfg.train.max_steps)
    if accelerator.is_main_process:
        export(final if final.is_dir() else resume_from, out)
        summary = {
            "steps": cfg.train.max_steps,
            "final_train_loss": state["final_train_loss"],
            "final_val_loss": state["final_val_loss"],
            "best_val_loss": state["best_val_loss"],
            "final_val_metrics": state.get("final_val_metrics"),
            "world_size": world,
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            "tokens_per_sec": (steady_tokens / steady_time) if steady_time else None,
            "mfu": mfu(flops_per_token, steady_tokens / steady_time, peak, world) if steady_time else None,
            "wall_time_s": time.perf_counter() - t_start,
            "time_to_first_step_s": first_step_s,
            "resumed_from": str(resume_from) if resume_from else None,
            "checkpoint_blocking_s": saver.blocking_s,  # the loop's time in checkpoint saves (checkpoint.async: the copy)
            "checkpoint_drain_s": saver.drain_s,  # the wait for the last background write, after the loop
            **peak_memory_mb(device),
            **engine_summary,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        say(f"[parallel_train] loss curves: {plot_runs([out], out / PICTURE)}")
        say(
            f"[parallel_train] done: {cfg.train.max_steps} steps, val loss {fmt(state['final_val_loss'])}, "
            f"{summary['wall_time_s']:.1f} s; outputs in {out}"
        )
    accelerator.wait_for_everyone()
    finish_trackers(accelerator, cfg.tracker, out, state["run_id"], say)  # also destroys the process group
    guard.signals.restore()
    return 0
