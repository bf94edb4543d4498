"""The training loop as a Trainer with named phases, read top to bottom:

    set up     output folder, Accelerator, data, model, optimizer, engine, resume, guards, trackers
    train      one optimizer step at a time (`train_step`), with `log`, `evaluate` and `save` when due
    finish     final weights, summary.json, the loss picture
    close      one clean-up path (try/finally), whatever ended the loop

Parallelism lives in the engine (parallel/engine.py; parallel/build.py picks one) and in the data sharding (data/batch_sampler.py):
nothing here depends on the topology. The optimizer step (step.py) and evaluation (evaluation.py) are the same
for every engine. What a checkpoint stores besides tensors is `self.state` (checkpoint/train_state.py).
"""

from __future__ import annotations

import time
import warnings

import torch
import yaml
from tqdm.auto import tqdm

from parallel_train import faults
from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.json_text import json_text
from parallel_train.checkpoint.named_state import torch_optimizer
from parallel_train.checkpoint.train_state import TrainingState
from parallel_train.checkpoint.writer import write_file, write_with
from parallel_train.config.sections import Config
from parallel_train.data.batch import rows
from parallel_train.data.batch_check import check_first_batches
from parallel_train.data.streaming import gather_positions, position_for
from parallel_train.data.text import train_loader, val_loader
from parallel_train.data.tokenizers import load_saved
from parallel_train.errors import UserError, is_first_process
from parallel_train.eval_metrics import chosen_metrics, user_metric
from parallel_train.evaluation import evaluate
from parallel_train.guards import RunGuard, stop_message
from parallel_train.models import MODELS
from parallel_train.models.hf_lora import check_same_base
from parallel_train.observe.messages import engine_lines, train_line
from parallel_train.observe.perf import (
    Throughput,
    TimedIterator,
    configure_backends,
    mfu,
    peak_flops,
    peak_memory_mb,
    process_age_s,
    sync_checked,
    sync_debug_mode,
)
from parallel_train.observe.plots import PICTURE, plot_runs
from parallel_train.observe.summary import run_summary
from parallel_train.observe.tracking import MetricsLog, finish_trackers, init_trackers, prepare_tracker_env
from parallel_train.optim import build_optimizer, build_scheduler
from parallel_train.parallel.accelerator import deepspeed_runs, make_accelerator, requested_precision
from parallel_train.parallel.build import build_engine, describe, shards_parameters, splits_the_model
from parallel_train.parallel.model_init import Whole, start_model
from parallel_train.parallel.precision import make_precision
from parallel_train.run.final_weights import own_folders, write_final_weights
from parallel_train.run.finished import meet_finished_run
from parallel_train.run.output_dir import check_output_dir, claim_run_files, lock_output_dir, write_run_files
from parallel_train.run.resume import choose_checkpoint
from parallel_train.run.resume_config import SCHEDULE, apply_schedule, change_notice, check_same_files, config_changes
from parallel_train.step import Stepper, StepResult
from parallel_train.tasks.registry import load_task_data, task_of
from parallel_train.tasks.task import Aligned, units_in


def say(message: str) -> None:
    """One line from the first process (before the Accelerator exists too)."""
    if is_first_process():
        tqdm.write(message)


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"  # None: not measured yet (no log or eval step so far)


class Trainer:
    def __init__(self, cfg: Config, config_path: str | None):
        """Set up everything the loop needs; nothing is trained yet. Every rank runs this, in this order."""
        self.t_start = time.perf_counter()
        self.cfg = cfg
        self.out = check_output_dir(cfg)
        self.ckpt_root = self.out / "checkpoints"
        tracker_word = prepare_tracker_env(cfg.tracker, self.out, say)

        self.accelerator = make_accelerator(cfg, say)
        # From here on the main process decides for every rank: who holds output_dir (run/output_dir.py), which checkpoint
        # the run continues from (run/resume.py). Nothing in output_dir is read before the lock is held.
        self.lock = lock_output_dir(self.out, self.accelerator.is_main_process, say)
        try:
            self._set_up(config_path, tracker_word)
        except BaseException:
            self.lock.release()
            raise

    def _set_up(self, config_path: str | None, tracker_word: str) -> None:
        """The checkpoint to continue from (every rank the same), then the banner, model, engine and outputs."""
        cfg = self.cfg
        # The user's metric file (eval.metric), first: a bad path or name stops the run before anything else is read.
        self.user_metric = user_metric(cfg.eval.metric) if cfg.eval.metric else None
        rerun = meet_finished_run(cfg, self.out)  # a run that finished here is never trained again (run/finished.py)
        self.resume_from = choose_checkpoint(cfg.resume, self.ckpt_root, warn=lambda m: say(f"warning: {m}"))
        self.done = rerun.done_from(self.resume_from, cfg.train.max_steps)
        if self.done:
            return
        rerun.refuse_unless(self.resume_from)
        # Before anything is trained: every file and folder the run will replace is its own, unchanged (run/output_dir.py).
        self.own_format = getattr(MODELS[cfg.model.name], "export", None)  # a model from elsewhere saves its own format too
        claim_run_files(self.out, self.accelerator.is_main_process, own_folders(cfg.model, self.own_format))
        # Keys that may change on resume apply from the resumed step; any other change stops here (run/resume_config.py).
        self.changes = config_changes(self.resume_from, cfg) if self.resume_from else {}
        self.device = self.accelerator.device
        self.precision = make_precision(requested_precision(cfg), self.device, self.accelerator.num_processes, deepspeed_runs())
        configure_backends(cfg.train, self.device, shards_parameters(cfg, self.accelerator.num_processes))
        self.sync_debug, notice = sync_debug_mode(self.device)  # PARALLEL_TRAIN_SYNC_DEBUG (the GPU benchmark scripts)
        if notice:
            say(notice)
        say(
            f"[parallel_train] {describe(self.accelerator)} | world size {self.accelerator.num_processes} | device {self.device} | "
            f"threads {torch.get_num_threads()} | "
            f"precision {self.precision.name} | config {config_path or 'defaults'} | output_dir {self.out} | tracker {tracker_word}"
        )
        self._set_up_model_and_engine()
        self._resume_or_start()
        self._open_outputs()

    def _set_up_model_and_engine(self) -> None:
        """Data, model, engine (which builds the optimizer over this rank's parameters), schedule. The same seed on
        every rank: identical initial weights."""
        cfg, rank = self.cfg, self.accelerator.process_index
        # The tokenizer of a resumed run is reused, so token ids cannot shift.
        self.task = task_of(cfg)  # tasks/: what the labels mean, where the data comes from, what validation reports
        self.data = load_task_data(cfg, self.task, load_saved(self.resume_from) if self.resume_from else None)
        self.labels = self.data.label_names if self.task.has_labels else None  # the head's size and the export's id2label
        if self.resume_from is not None:
            check_same_files(self.resume_from, self.data.files)
        if self.data.description:
            say(f"[parallel_train] data: {self.data.description}")
        # What validation reports: the task's metrics (entity F1 reads the data's tag names), then the user's.
        self.val_metrics, notice = chosen_metrics(self.task.metrics, self.data.label_names, self.user_metric)
        if notice:
            say(notice)
        # On the meta device when the model can start there: no rank builds the whole model (parallel/model_init.py).
        model, init = start_model(MODELS[cfg.model.name], cfg.model, self.data.vocab_size, cfg.train.seed, self.labels)
        if getattr(model, "notice", None):  # e.g. a new head on a pretrained body (models/hf.py)
            say(model.notice)
        params = list(model.parameters())  # on the meta device when it starts there: shapes only; a tied weight once
        self.params = {
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "total_params": sum(p.numel() for p in params),
        }
        self.base_model = model.base_model() if hasattr(model, "base_model") else None  # what LoRA checkpoints need
        if isinstance(init, Whole) and splits_the_model(cfg, self.accelerator.num_processes):
            say(
                f"notice: model.name={cfg.model.name} has no init_weights(name, module), so every rank builds the whole model "
                "before it is sharded; add one for a meta-device start (models/gpt.py, src/parallel_train/parallel/model_init.py)"
            )
        first = lambda: next(iter(val_loader(self.data, cfg, 1)))  # noqa: E731
        check_first_batches(model, self.data, cfg, self.task, first())  # keys, labels, ids the model lacks: one line, before any step
        probe = lambda: rows(first(), 0, cfg.train.batch_size)  # noqa: E731 (parallel.split=time)
        make_optimizer = lambda m: build_optimizer(m, cfg.train)  # noqa: E731 (over the parameters this rank holds)
        self.engine = build_engine(cfg, self.accelerator, model, init, make_optimizer, self.precision, probe)
        self.start_memory = peak_memory_mb(self.device)  # the model in place, cut and filled: what the start cost
        self.optimizer = torch_optimizer(self.engine.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        # A causal LM's dict labels are shifted once here (tasks/task.py); every other batch passes as it is.
        self.val_batches = Aligned(self.task, val_loader(self.data, cfg, self.engine.dp_size))
        self.global_batch = cfg.train.batch_size * self.engine.dp_size * cfg.train.gradient_accumulation_steps
        for line in engine_lines(self.engine, cfg.train, self.global_batch, self.params):
            say(line)
        torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank dropout masks

    def _resume_or_start(self) -> None:
        """The training state: a fresh one, or the checkpoint's (weights, optimizer, schedule and RNG restored)."""
        self.state = TrainingState()
        if self.resume_from is not None:
            saved = checkpointer.read_json(self.resume_from / "trainer_state.json").get("base_model")
            notice = check_same_base(saved, self.base_model, self.resume_from)  # before its adapters are loaded
            if notice:
                say(notice)
            self.state = checkpointer.load(self.resume_from, self.engine, self.scheduler, self.precision)
            say(f"[parallel_train] resumed from {self.resume_from} at step {self.state.step}")
            if any(key in SCHEDULE for key in self.changes):
                apply_schedule(self.scheduler, self.cfg.train.learning_rate)
            if notice := change_notice(self.changes, self.state.step):
                say(notice)
            notice = checkpointer.topology_notice(self.state, self.accelerator.num_processes, self.global_batch)
            if notice:
                say(notice)
        self.start_step = self.state.step
        self.state.world_size, self.state.global_batch = self.accelerator.num_processes, self.global_batch
        self.state.base_model = self.base_model
        # guards.py: stop signals, non-finite loss/gradients, the stop step all ranks agree on
        self.guard = RunGuard(self.accelerator, self.cfg.train.max_skipped_steps, self.cfg.parallel.timeout_s, self.state.skipped_steps)
        units = lambda batch: units_in(self.task, batch)  # noqa: E731 (throughput's units, counted on the host)
        self.stepper = Stepper(self.engine, self.precision, self.cfg.train, self.data.all_targets_count, self.guard.update_allowed, units)
        self.stepper.skipped_by_scaler, self.stepper.skipped_empty = self.state.scaler_skipped_steps, self.state.skipped_empty_steps
        # Test-only fault injection, one hook called after every step: a no-op unless PARALLEL_TRAIN_FAULT is set.
        self.fault_hook = faults.step_hook(self.engine.model, lambda: self.guard.step)

    def _open_outputs(self) -> None:
        """config.yaml and the tokenizer (vocab.json or tokenizer.json), metrics.jsonl (cut back to the resumed step),
        trackers, the batch stream."""
        cfg, accelerator = self.cfg, self.accelerator
        self.config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        # The tokenizer and what goes with it (a chat template: Data.files), in output_dir and every checkpoint.
        self.tokenizer_files = {**(self.data.vocab.files() if self.data.vocab else {}), **self.data.files}
        self.metrics = MetricsLog(self.out / "metrics.jsonl", accelerator, cfg.tracker)
        self.metrics.truncate_after(self.start_step, say)  # first: a metrics.jsonl it cannot read stops the run before any write
        if accelerator.is_main_process:
            write_run_files(self.out, self.config_yaml, self.data.vocab, self.data.files)
        init_trackers(accelerator, cfg.tracker, cfg.to_dict(), self.out, self.state.run_id)
        position, notice = position_for(self.state.data_position, self.engine.dp_size, self.engine.dp_rank)
        if notice:  # a stream saved by another number of data-parallel ranks
            say(notice)
        self.loader = train_loader(
            self.data, cfg, self.engine.dp_size, self.engine.dp_rank, self.start_step, self.device.type == "cuda", stream_state=position
        )
        self.batches = TimedIterator(iter(Aligned(self.task, self.loader)))
        # MFU counts FLOPs per token: none for a task whose throughput is in samples (tasks/task.py), where it means nothing
        self.flops_per_token = self.engine.flops_per_token() if self.task.units == "tokens" else None
        self.peak = peak_flops(self.device, self.precision.name, cfg.train)
        self.speed = Throughput()
        self.first_step_s: float | None = None
        c = cfg.checkpoint  # every rank writes its own part; with checkpoint.async in the background (checkpoint/checkpointer.py)
        self.saver = checkpointer.Checkpointer(self.ckpt_root, c.keep, c.keep_best, self.resume_from, c.async_, cfg.parallel.timeout_s)
        self.pbar = tqdm(
            total=cfg.train.max_steps,
            initial=self.start_step,
            disable=None if accelerator.is_main_process else True,
            dynamic_ncols=True,
            desc="train",
        )

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        """Train to train.max_steps (or an agreed stop), then finish; close on every way out."""
        if self.done:  # a finished run met again: one line, nothing written, the lock file gone again
            say(self.done)
            self.accelerator.wait_for_everyone()
            self.accelerator.end_training()  # the process group, as close() ends it
            self.lock.release()
            return 0
        finished_cleanly = False
        self.guard.signals.install()  # from here on SIGTERM/SIGUSR1/SIGINT stop at an agreed step, with a checkpoint
        try:
            if self.train():
                self.finish()
            finished_cleanly = True
        finally:
            self.close(finished_cleanly)
        return 0

    def train(self) -> bool:
        """The steps from the resumed one on. False if a stop signal ended them early (a checkpoint was written)."""
        cfg = self.cfg
        for _ in range(self.start_step, cfg.train.max_steps):
            lr = self.optimizer.param_groups[0]["lr"]
            with sync_checked(self.sync_debug if self.state.step > self.start_step else None):  # after the first step
                result, done = self.train_step()
            # All ranks agree on "stop signal?" and "non-finite?" (raises naming the step) before anything is logged or saved.
            stop = self.guard.end_step(done, result.loss_sum, force=self.due(cfg.train.log_interval) or self.due(cfg.checkpoint.interval))
            if self.due(cfg.train.log_interval):
                self.log(result, lr)
            t_pause = time.perf_counter()
            if self.due(cfg.eval.interval):
                self.evaluate()
            preempted = stop is not None and done < cfg.train.max_steps
            if self.due(cfg.checkpoint.interval) or preempted:
                self.save()
            self.speed.pause(time.perf_counter() - t_pause)  # evaluation and checkpoints are not training time
            if preempted:  # the checkpoint is written on all ranks; leave cleanly
                self.saver.finish()
                self.pbar.close()
                say(stop_message(stop, done, cfg.train.max_steps, self.ckpt_root / checkpointer.checkpoint_name(done)))
                return False
        return True

    def train_step(self) -> tuple[StepResult, int]:
        """One optimizer step (step.py; the engine runs the micro-batches). Returns its losses (device tensors) and the step."""
        self.guard.begin_step(self.state.step + 1)
        result = self.stepper.step(self.batches, self.state.step + 1)
        if result.empty:  # known on the host (step.py): no optimizer step was taken
            with warnings.catch_warnings():  # torch's warning of a schedule stepped before its optimizer: here that is the plan
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                self.scheduler.step()
        else:
            self.scheduler.step()
        self.state.step += 1
        self.fault_hook(self.state.step)
        self.speed.add(result.units)  # this rank's; summed over the ranks when logged
        self.pbar.update(1)
        if self.first_step_s is None:  # from the process's start: imports and set-up count
            self.first_step_s = process_age_s() or time.perf_counter() - self.t_start
            self.first_step_memory = peak_memory_mb(self.device)  # the start's peak: model built, cut, filled, one step
        return result, self.state.step

    def settle(self) -> list[int]:
        """The steps skipped since the last call, read from the device (step.py) where the loop syncs anyway: log,
        checkpoint, end. A step with no token to learn is still a step of the schedule; the first one says what it is."""
        first = self.stepper.skipped_empty == 0
        empty = self.stepper.settle()
        if empty and first:  # the rest are counted
            say(f"notice: step {empty[0]} has no token to learn on any rank: skipped (no update); counted in skipped_empty_steps")
        return empty

    def due(self, interval: int) -> bool:
        """Whether the step just done is a log/eval/checkpoint step for this interval (the last step always is)."""
        step = self.state.step
        return step == self.cfg.train.max_steps or (interval > 0 and step % interval == 0)

    def log(self, result: StepResult, lr: float) -> None:
        """The train record of this interval. The only host-device sync of the step, and only on log steps."""
        # Per token, over ranks and micro-batches: a collective. None (null): a skipped step had nothing to learn.
        done, interval = self.state.step, self.cfg.train.log_interval
        empty = self.settle()
        loss = self.stepper.mean_loss(result).item()  # a collective: every rank calls it, the empty step's too
        train_loss = None if result.empty or done in empty else loss
        if train_loss is not None:
            self.state.final_train_loss = train_loss
        # Throughput in the task's units (tasks/task.py), this interval's counts of every rank summed (a collective)
        units = self.stepper.over_ranks(self.speed.pending)
        rate, elapsed = self.speed.interval(warm=done > self.start_step + interval, units=units)  # the first holds warm-up
        record = {
            "kind": "train",
            "step": done,
            "loss": train_loss,
            "lr": lr,
            f"{self.task.units}_per_sec": rate,  # tokens_per_sec (not padding) or samples_per_sec
            "step_time_s": elapsed / (min(interval, done - self.start_step) or 1),
            "data_time_frac": min(1.0, self.batches.seconds / elapsed),
            "mfu": mfu(self.flops_per_token, rate, self.peak, self.accelerator.num_processes),
        }
        balance = getattr(self.engine, "balance", None)  # MoE layers (parallel/router_balance.py): aux_loss, expert_load
        if balance is not None:
            record.update(balance.report())
        if self.precision.scaler is not None:  # fp16: updates the loss scaler skipped on an overflow, so far
            record["skipped_by_scaler"] = self.stepper.skipped_by_scaler
        if not self.data.all_targets_count:  # samples with ignored targets: steps with nothing to learn, so far
            record["skipped_empty_steps"] = self.stepper.skipped_empty
        self.batches.seconds = 0.0
        self.metrics.log(record)
        self.pbar.set_postfix(loss=fmt(train_loss), **{"tok_s" if self.task.units == "tokens" else "samples_s": f"{rate:,.0f}"})
        say(train_line(record, self.cfg.train.max_steps))  # plain lines: the bar is off when stderr is not a terminal

    def evaluate(self) -> None:
        """Every validation metric over the fixed eval set (a collective); logged, and kept in the state. A metric that
        fails (eval.metric: every rank raises alike, evaluation.py) stops the run after this step's checkpoint is written."""
        state, done = self.state, self.state.step
        try:
            val = evaluate(self.engine, self.val_batches, self.val_metrics)  # {"loss": ..., then the others chosen}
        except UserError as e:
            self.save()  # a collective, as the evaluation was: every rank is here
            self.saver.finish()
            where = self.ckpt_root / checkpointer.checkpoint_name(done)
            raise UserError(f"{e} (step {done}'s checkpoint is written first: {where}; a rerun resumes from it)") from None
        state.final_val_loss, state.final_val_step = val["loss"], done
        state.final_val_metrics = {f"val_{name}": value for name, value in val.items()}
        if val["loss"] is not None and (state.best_val_loss is None or val["loss"] < state.best_val_loss):
            state.best_val_loss = val["loss"]
        self.metrics.log({"kind": "eval", "step": done, **state.final_val_metrics})
        others = "".join(f", val {name} {fmt(value)}" for name, value in val.items() if name != "loss")
        say(f"step {done}: train loss {fmt(state.final_train_loss)}, val loss {fmt(val['loss'])}{others}")
        if val["loss"] is None:  # eval_metrics.py: a ratio over nothing is not measured
            say(f"notice: step {done}: the validation batches hold no token to learn; val metrics are null (not measured)")

    def save(self) -> None:
        """A checkpoint of this step (a collective): weights, optimizer, schedule, every rank's RNG, the state."""
        self.settle()  # the skipped steps so far, read from the device
        self.state.skipped_steps, self.state.scaler_skipped_steps = self.guard.skipped, self.stepper.skipped_by_scaler
        self.state.skipped_empty_steps = self.stepper.skipped_empty
        # A collective; None unless the data is a stream (one position per data-parallel rank).
        self.state.data_position = gather_positions(self.loader, self.engine.dp_size, self.engine.dp_rank)
        self.saver.save(self.engine, self.state, self.scheduler, self.precision, self.config_yaml, self.tokenizer_files)

    # ---------------------------------------------------------------- the end

    def finish(self) -> None:
        """Final weights (whole model, canonical names), summary.json and the loss picture."""
        cfg, out = self.cfg, self.out
        self.pbar.close()
        if self.start_step >= cfg.train.max_steps:
            say(f"[parallel_train] the checkpoint is already at train.max_steps={cfg.train.max_steps}; nothing to train")
        engine_summary = self.engine.finish(out)  # a collective: e.g. the pipeline timeline
        self.saver.finish()  # the last checkpoint (always written at max_steps) is on disk
        if not self.accelerator.is_main_process:
            return
        final = self.ckpt_root / checkpointer.checkpoint_name(cfg.train.max_steps)
        source = final if final.is_dir() else self.resume_from
        written = write_final_weights(source, out, cfg.model, self.own_format, self.data, self.labels)
        if written:
            say(f"[parallel_train] {written}")
        self.settle()
        summary = {**run_summary(self), **engine_summary}
        write_file(out / "summary.json", json_text(summary, indent=1))
        say(f"[parallel_train] loss curves: {write_with(out / PICTURE, lambda path: plot_runs([out], path))}")
        say(
            f"[parallel_train] done: {cfg.train.max_steps} steps, val loss {fmt(self.state.final_val_loss)}, "
            f"{summary['wall_time_s']:.1f} s; outputs in {out}"
        )

    def close(self, finished_cleanly: bool) -> None:
        """The one way out. After an error the process group may be broken (a peer died): tearing it down could
        hang, and errors.run_cli ends the process anyway, so trackers and the group are closed on clean exits only."""
        self.pbar.close()
        self.guard.signals.restore()
        if finished_cleanly:
            self.accelerator.wait_for_everyone()
            finish_trackers(self.accelerator, self.cfg.tracker, self.out, self.state.run_id, say)  # also destroys the process group
        self.lock.release()  # last: nothing is written to output_dir after it (a SIGKILL releases it too, through the OS)


def run(cfg: Config, config_path: str | None) -> int:
    return Trainer(cfg, config_path).run()
