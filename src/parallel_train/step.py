"""One optimizer step, the same for every engine (parallel/engine.py supplies only forward/backward and the gradient sync):

    micro-batches      this rank's gradient_accumulation_steps slices of the global batch
    count              valid targets (not IGNORE_INDEX) of the WHOLE step: every micro-batch, every data-parallel
                       rank (one all-reduce of one number; none when the data says every target counts)
    forward/backward   the engine runs the micro-batches; each one's summed token loss x dp_size / count goes
                       backward (x the fp16 loss scale), and gradients are synchronised once per step
    unscale, clip      fp16: gradients unscaled; then the global gradient norm (the engine knows where its
                       gradients live: whole, DTensor shards, pipeline stages) and clipping
    guard, update      a non-finite loss or gradient: guards.py skips or stops; an fp16 overflow: the scaler
                       skips the update and lowers its scale, and the run goes on

A step with no target to learn on any rank (chat samples whose answers data.truncate cut away, all of them in this
step's batch) is skipped whole: no forward, no backward, no update, since a step over nothing has no gradient and
an update would still move the weights (weight decay, momentum). It is counted (`skipped_empty`: the train log
record and summary.json's `skipped_empty_steps`), its loss is None (null in metrics.jsonl), and it still counts as
a step: the learning-rate schedule and the data order are functions of the step number and go on, as they do for a
non-finite step the guard skips. Every rank takes the same decision: the count is summed over all ranks.

Why dp_size / count: every engine's gradient sync (DDP, FSDP2, the pipeline's replicas) AVERAGES over the
data-parallel ranks; multiplying each rank's loss by dp_size first turns that average into the sum over ranks,
so the gradient is that of (sum of every valid token's loss in the step) / (their number): the per-token mean of
the global batch, equal on every topology whatever the padding. torchtitan gets the same numbers by setting
FSDP's gradient divide factor to 1 instead. With fixed windows (no padding) this is exactly the mean of the
micro-batch means that the loop computed before the loss was counted per token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from parallel_train.checkpoint.named_state import torch_optimizer
from parallel_train.data.batch import Batch, targets
from parallel_train.losses import valid_tokens
from parallel_train.parallel.collectives import all_reduce_small
from parallel_train.parallel.precision import Precision


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed token loss of the step (device tensor; zero where it holds no loss)
    count: torch.Tensor  # valid targets of the whole step, all ranks: the loss's denominator
    tokens: int  # tokens this rank read (throughput)
    empty: bool = False  # no target to learn on any rank: skipped (no forward, backward or update)


class Stepper:
    """`step(batches)`: one optimizer step of `engine`; `mean_loss(result)`: its loss per token (a collective)."""

    def __init__(self, engine, precision: Precision, cfg, every_target_counts: bool, gate) -> None:
        self.engine, self.precision, self.cfg, self.gate = engine, precision, cfg, gate  # cfg: the train section
        self.every_target_counts = every_target_counts  # the data has no IGNORE_INDEX targets: count = numel
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.skipped_by_scaler = 0  # fp16 steps whose update the loss scaler skipped (an overflow)
        self.skipped_empty = 0  # steps with no target to learn on any rank, skipped whole

    def step(self, batches: Iterator[Batch]) -> StepResult:
        engine = self.engine
        micro = [next(batches) for _ in range(self.cfg.gradient_accumulation_steps)]
        count = self.count(micro)
        tokens = sum(targets(b).numel() for b in micro)
        # Only data with ignored targets can have a step with none to learn. Reading the count is a host sync, on
        # that path only (windows of text, where every target counts, never pay it); the count was all-reduced
        # already, so every rank skips alike. Issue 27 (no host sync in the step) may defer this test to the
        # update, as the guard's skip does.
        if not self.every_target_counts and not int(count):
            self.skipped_empty += 1
            return StepResult(torch.zeros((), device=engine.device), count, 0, empty=True)  # nothing trained: no tokens/s
        scale = engine.dp_size / count.clamp(min=1).to(torch.float32)  # a tensor: no host sync
        loss_sum = engine.forward_backward(micro, scale, self.precision)
        grad_norm = self._unscale_and_clip()
        self._update(loss_sum, grad_norm)
        engine.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, count, tokens)

    def count(self, micro: list[Batch]) -> torch.Tensor:
        """Valid targets of the step over every data-parallel rank, on the engine's device."""
        device = self.engine.device
        if self.every_target_counts:  # windows of text: every rank reads as many targets, none ignored
            return torch.tensor(sum(targets(b).numel() for b in micro) * self.engine.dp_size, device=device)
        local = sum(valid_tokens(targets(b)) for b in micro).reshape(1)
        # Every process reads a batch; those that read the same one (tensor-parallel and pipeline peers) count it
        # again: world / dp_size copies of each data-parallel rank's count.
        total = all_reduce_small(local, torch.distributed.ReduceOp.SUM, device)
        return (total[0] * self.engine.dp_size // self.world).to(device)

    def _unscale_and_clip(self) -> torch.Tensor | None:
        """fp16: unscale the gradients first (the norm and the clip are in real units). The norm is needed to
        clip, and to skip non-finite steps (inf: measure without clipping)."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.grad_clip or (math.inf if self.cfg.max_skipped_steps else 0)
        return self.engine.clip_grad_norm(max_norm) if max_norm else None

    def _update(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        scaler = self.precision.scaler
        # An fp16 overflow in the gradients is the scaler's to handle: only the loss is the guard's then.
        if not self.gate(loss_sum, None if scaler is not None else grad_norm):  # guards.py: skip a non-finite step
            return
        if scaler is None:
            self.engine.optimizer.step()
            return
        before = scaler.get_scale()  # a host sync, with fp16 only: the one way to learn that the scaler skipped
        scaler.step(self.optimizer)
        scaler.update()
        if scaler.get_scale() < before:
            self.skipped_by_scaler += 1

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return torch_optimizer(self.engine.optimizer)

    def mean_loss(self, result: StepResult) -> torch.Tensor:
        """The step's loss per valid token over all ranks, for logging. A collective."""
        mine = result.loss_sum.detach() if self.engine.loss_owner else torch.zeros((), device=result.loss_sum.device)
        total = all_reduce_small(mine.reshape(1).float(), torch.distributed.ReduceOp.SUM, self.engine.device)
        return total[0].cpu() / result.count.clamp(min=1).cpu()
