"""The training loop as a Trainer with named phases, read top to bottom:

    set up     output folder, Accelerator, data, model, optimizer, engine, resume, guards, trackers
    train      one optimizer step at a time (`train_step`), with `log`, `evaluate` and `save` when due
    finish     final weights, summary.json, the loss picture
    close      one clean-up path (try/finally), whatever ended the loop

Parallelism lives in the engine (parallel/engine.py; parallel/build.py picks one) and in the data sharding (data/batch_sampler.py):
nothing here depends on the topology. The optimizer step (step.py) and evaluation (evaluation.py) are the same
for every engine. What a checkpoint stores besides tensors is `self.state` (checkpoint/train_state.py).
The work of each phase lives in its room: the run's folder, its files, resuming and the final weights in run/,
the records and lines a run shows in observe/, the optimizer step in step.py; the Trainer keeps their order.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from parallel_train import faults
from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.named_state import torch_optimizer
from parallel_train.config.sections import Config
from parallel_train.core.task import Aligned, units_in
from parallel_train.data.batch import rows
from parallel_train.data.batch_check import check_first_batches
from parallel_train.data.streaming import gather_positions, resumed_loader
from parallel_train.data.text import val_loader
from parallel_train.data.tokenizers import load_saved
from parallel_train.errors import is_first_process
from parallel_train.eval_metrics import chosen_metrics, user_metric
from parallel_train.evaluation import evaluate_or_stop
from parallel_train.guards import RunGuard, stop_message
from parallel_train.models import MODELS
from parallel_train.observe.messages import bar_fields, engine_lines, eval_lines, progress_bar, start_line, train_line
from parallel_train.observe.perf import (
    Throughput,
    TimedIterator,
    configure_backends,
    peak_flops,
    peak_memory_mb,
    process_age_s,
    sync_checked,
    sync_debug_mode,
)
from parallel_train.observe.summary import parameter_counts, run_summary, train_record, write_summary
from parallel_train.observe.tracking import finish_trackers, prepare_tracker_env
from parallel_train.optim import build_optimizer, build_scheduler, step_schedule
from parallel_train.parallel.accelerator import deepspeed_runs, make_accelerator, requested_precision
from parallel_train.parallel.build import build_engine, describe, shards_parameters, whole_start_notice
from parallel_train.parallel.model_init import start_model
from parallel_train.parallel.precision import make_precision
from parallel_train.run.final_weights import final_checkpoint, own_folders, write_final_weights
from parallel_train.run.finished import meet_finished_run
from parallel_train.run.output_dir import check_output_dir, claim_run_files, lock_output_dir, open_run_files
from parallel_train.run.resume import choose_checkpoint, resumed_state
from parallel_train.run.resume_config import check_same_files, config_changes
from parallel_train.step import Stepper, StepResult
from parallel_train.tasks.registry import load_task_data, task_of


def say(message: str) -> None:
    """One line from the first process (before the Accelerator exists too)."""
    if is_first_process():
        tqdm.write(message)


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
        launch, world = describe(self.accelerator), self.accelerator.num_processes
        say(start_line(launch, world, self.device, self.precision.name, config_path, self.out, tracker_word))
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
        self.params = parameter_counts(model)  # trainable_params, total_params (and active_params of a mixture of experts)
        self.base_model = model.base_model() if hasattr(model, "base_model") else None  # what LoRA checkpoints need
        if notice := whole_start_notice(init, cfg, self.accelerator.num_processes):
            say(notice)
        first = lambda: next(iter(val_loader(self.data, cfg, 1)))  # noqa: E731
        check_first_batches(model, self.data, cfg, self.task, first())  # keys, labels, ids the model lacks: one line, before any step
        probe = lambda: rows(first(), 0, cfg.train.batch_size)  # noqa: E731 (parallel.split=time)
        make_optimizer = lambda m: build_optimizer(m, cfg.train)  # noqa: E731 (over the parameters this rank holds)
        self.engine = build_engine(cfg, self.accelerator, model, init, make_optimizer, self.precision, probe)
        self.start_memory = peak_memory_mb(self.device)  # the model in place, cut and filled: what the start cost
        self.optimizer = torch_optimizer(self.engine.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        # A causal LM's dict labels are shifted once here (core/task.py); every other batch passes as it is.
        self.val_batches = Aligned(self.task, val_loader(self.data, cfg, self.engine.dp_size))
        self.global_batch = cfg.train.batch_size * self.engine.dp_size * cfg.train.gradient_accumulation_steps
        for line in engine_lines(self.engine, cfg.train, self.global_batch, self.params):
            say(line)
        torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank dropout masks

    def _resume_or_start(self) -> None:
        """The training state: a fresh one, or the checkpoint's (weights, optimizer, schedule and RNG restored)."""
        world = (self.accelerator.num_processes, self.global_batch)  # this launch's, against the checkpoint's (run/resume.py)
        resumed = (self.engine, self.scheduler, self.precision)  # filled from the checkpoint
        self.state = resumed_state(self.resume_from, *resumed, self.changes, self.cfg.train.learning_rate, self.base_model, world, say)
        self.start_step = self.state.step
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
        cfg, accelerator, dp = self.cfg, self.accelerator, (self.engine.dp_size, self.engine.dp_rank)
        opened = open_run_files(self.out, cfg, accelerator, self.data, self.start_step, self.state.run_id, say)  # run/output_dir.py
        self.config_yaml, self.tokenizer_files, self.metrics = opened  # the tokenizer's files go in every checkpoint too
        pin, position = self.device.type == "cuda", self.state.data_position  # a stream's: where each rank stood
        self.loader = resumed_loader(self.data, cfg, *dp, self.start_step, pin, position, say)
        self.batches = TimedIterator(iter(Aligned(self.task, self.loader)))
        # MFU counts FLOPs per token: none for a task whose throughput is in samples (core/task.py), where it means nothing
        self.flops_per_token = self.engine.flops_per_token() if self.task.units == "tokens" else None
        self.peak = peak_flops(self.device, self.precision.name, cfg.train)
        self.speed = Throughput()
        self.first_step_s: float | None = None
        c = cfg.checkpoint  # every rank writes its own part; with checkpoint.async in the background (checkpoint/checkpointer.py)
        self.saver = checkpointer.Checkpointer(self.ckpt_root, c.keep, c.keep_best, self.resume_from, c.async_, cfg.parallel.timeout_s)
        self.pbar = progress_bar(cfg.train.max_steps, self.start_step, accelerator.is_main_process)

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
        step_schedule(self.scheduler, result.empty)  # result.empty, known on the host (step.py): no update was taken
        self.state.step += 1
        self.fault_hook(self.state.step)
        self.speed.add(result.units)  # this rank's; summed over the ranks when logged
        self.pbar.update(1)
        if self.first_step_s is None:  # from the process's start: imports and set-up count
            self.first_step_s = process_age_s() or time.perf_counter() - self.t_start
            self.first_step_memory = peak_memory_mb(self.device)  # the start's peak: model built, cut, filled, one step
        return result, self.state.step

    def due(self, interval: int) -> bool:
        """Whether the step just done is a log/eval/checkpoint step for this interval (the last step always is)."""
        step = self.state.step
        return step == self.cfg.train.max_steps or (interval > 0 and step % interval == 0)

    def log(self, result: StepResult, lr: float) -> None:
        """The train record of this interval. The only host-device sync of the step, and only on log steps."""
        # Per token, over ranks and micro-batches: a collective. None (null): a skipped step had nothing to learn.
        empty = self.stepper.settle(say)
        loss = self.stepper.mean_loss(result).item()  # a collective: every rank calls it, the empty step's too
        train_loss = None if result.empty or self.state.step in empty else loss
        if train_loss is not None:
            self.state.final_train_loss = train_loss
        # Throughput in the task's units (core/task.py), this interval's counts of every rank summed (a collective)
        record = train_record(self, train_loss, lr, self.stepper.over_ranks(self.speed.pending))  # observe/summary.py
        self.batches.seconds = 0.0
        self.metrics.log(record)
        self.pbar.set_postfix(bar_fields(record))
        say(train_line(record, self.cfg.train.max_steps))  # plain lines: the bar is off when stderr is not a terminal

    def evaluate(self) -> None:
        """Every validation metric over the fixed eval set (a collective); logged, and kept in the state. A metric that
        fails (eval.metric: every rank raises alike, evaluation.py) stops the run after this step's checkpoint is written."""
        state, done = self.state, self.state.step
        val = evaluate_or_stop(self.engine, self.val_batches, self.val_metrics, done, lambda: self.save(wait=True))
        state.add_eval(val, done)  # {"loss": ..., then the others chosen}: the last, and the best loss so far
        self.metrics.log({"kind": "eval", "step": done, **state.final_val_metrics})
        for line in eval_lines(done, state.final_train_loss, val):
            say(line)

    def save(self, wait: bool = False) -> Path:
        """A checkpoint of this step (a collective): weights, optimizer, schedule, every rank's RNG, the state. Returns
        its folder; `wait`: until it is on disk (checkpoint.async writes it in the background)."""
        self.stepper.settle(say)  # the skipped steps so far, read from the device
        self.state.skipped_steps, self.state.scaler_skipped_steps = self.guard.skipped, self.stepper.skipped_by_scaler
        self.state.skipped_empty_steps = self.stepper.skipped_empty
        # A collective; None unless the data is a stream (one position per data-parallel rank).
        self.state.data_position = gather_positions(self.loader, self.engine.dp_size, self.engine.dp_rank)
        self.saver.save(self.engine, self.state, self.scheduler, self.precision, self.config_yaml, self.tokenizer_files)
        if wait:
            self.saver.finish()
        return self.ckpt_root / checkpointer.checkpoint_name(self.state.step)

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
        source = final_checkpoint(self.ckpt_root, cfg.train.max_steps, self.resume_from)
        if written := write_final_weights(source, out, cfg.model, self.own_format, self.data, self.labels):
            say(f"[parallel_train] {written}")
        self.stepper.settle(say)
        write_summary(out, {**run_summary(self), **engine_summary}, say)  # summary.json, the loss picture, the last line

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
