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
step's batch) is skipped: no update, since a step over nothing has no gradient and an update would still move the
weights (weight decay, momentum). It is counted (`skipped_empty`: the train log record and summary.json's
`skipped_empty_steps`), its loss is None (null in metrics.jsonl), and it still counts as a step: the learning-rate
schedule and the data order are functions of the step number and go on, as they do for a non-finite step the guard
skips. Every rank takes the same decision: the count is summed over all ranks.

No host sync on a step that neither logs nor agrees (issue 27): on a GPU every wait for the device stops the host from
queueing the next kernels. The count is made on the device (a fill, or the host's count of the CPU batch all-reduced
there), never read; what throughput counts is counted on the host from the CPU batch before it moves
(core/task.py `units_in`). The empty step is decided on the device too: its forward and backward run (a loss of 0,
gradients of 0) and the optimizer is handed the verdict as `found_inf`, the flag with which torch's fused optimizers
skip an update on the device (GradScaler's own way): weights and moments stay as they were. Its flag is read with the
others when the loop syncs anyway (`settle`: log, checkpoint, end). Where the optimizer cannot skip on the device (not
fused: SGD, DeepSpeed's; or under fp16, whose scaler owns that flag) the count is read on the host instead, on data
with ignored targets only, and such a step skips its forward and backward too. fp16's skipped updates are counted on
the device from the scaler's scale (lowered by an overflow), read with the rest.

Why dp_size / count: every engine's gradient sync (DDP, FSDP2, the pipeline's replicas) AVERAGES over the
data-parallel ranks; multiplying each rank's loss by dp_size first turns that average into the sum over ranks,
so the gradient is that of (sum of every valid token's loss in the step) / (their number): the per-token mean of
the global batch, equal on every topology whatever the padding. torchtitan gets the same numbers by setting
FSDP's gradient divide factor to 1 instead. With fixed windows (no padding) this is exactly the mean of the
micro-batch means that the loop computed before the loss was counted per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from parallel_train.checkpoint.named_state import torch_optimizer
from parallel_train.core.collectives import all_reduce_small
from parallel_train.data.batch import Batch, targets
from parallel_train.losses import valid_on_host
from parallel_train.parallel.precision import Precision


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed token loss of the step (device tensor; zero where it holds no loss)
    count: torch.Tensor  # valid targets of the whole step, all ranks: the loss's denominator (device tensor)
    units: int  # what throughput counts (task.units: tokens or samples) in this rank's batches, counted on the host
    empty: bool = False  # read on the host already: no target on any rank, skipped whole (no forward, backward, update)


class Stepper:
    """`step(batches, number)`: one optimizer step of `engine`; `mean_loss(result)`: its loss per token (a collective);
    `settle()`: what the steps since the last call skipped, read from the device."""

    def __init__(self, engine, precision: Precision, cfg, every_target_counts: bool, gate, units=lambda b: 0) -> None:
        self.engine, self.precision, self.cfg, self.gate = engine, precision, cfg, gate  # cfg: the train section
        self.every_target_counts = every_target_counts  # the data has no IGNORE_INDEX targets: count = numel
        self.units = units  # a CPU batch -> what throughput counts in it (core/task.py units_in)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.skipped_by_scaler = 0  # fp16 steps whose update the loss scaler skipped (an overflow), as of the last settle
        self.skipped_empty = 0  # steps with no target to learn on any rank, skipped, as of the last settle
        self._empty: list[tuple[int, torch.Tensor | bool]] = []  # (step, its verdict) since the last settle
        self._scaler_skips: list[torch.Tensor] = []  # fp16: 1 where the scaler lowered its scale, since the last settle
        self._counts: dict[int, torch.Tensor] = {}  # the count of fixed windows, made once per size

    def step(self, batches: Iterator[Batch], number: int = 0) -> StepResult:
        engine = self.engine
        micro = [next(batches) for _ in range(self.cfg.gradient_accumulation_steps)]
        units = sum(self.units(b) for b in micro)
        count = self.count(micro)
        empty = None if self.every_target_counts else count == 0  # a device bool: never read here
        if empty is not None and not self.skips_on_device:
            # The one host read left, and only where the optimizer cannot take the verdict on the device (see above).
            # The count was all-reduced already, so every rank skips alike.
            if not int(count):
                self._empty.append((number, True))
                return StepResult(torch.zeros((), device=engine.device), count, 0, empty=True)  # nothing trained
            empty = None
        scale = engine.dp_size / count.clamp(min=1).to(torch.float32)  # a tensor: no host sync
        loss_sum = engine.forward_backward(micro, scale, self.precision)
        grad_norm = self._unscale_and_clip()
        self._update(loss_sum, grad_norm, empty)
        if empty is not None:
            self._empty.append((number, empty))
        engine.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, count, units)

    @property
    def skips_on_device(self) -> bool:
        """The optimizer takes a skip verdict on the device (`found_inf`: torch's fused AdamW and Adam); not under fp16."""
        return self.precision.scaler is None and bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def count(self, micro: list[Batch]) -> torch.Tensor:
        """Valid targets of the step over every data-parallel rank, on the engine's device, made without a host read."""
        device = self.engine.device
        if self.every_target_counts:  # windows of text: every rank reads as many targets, none ignored
            n = sum(targets(b).numel() for b in micro) * self.engine.dp_size
            if n not in self._counts:  # a fill on the device (not a copy of a host tensor), kept: the size is fixed
                self._counts[n] = torch.full((), n, dtype=torch.int64, device=device)
            return self._counts[n]
        return self._over_ranks(sum(valid_on_host(targets(b)) for b in micro))

    def _over_ranks(self, n: int) -> torch.Tensor:
        """A count each rank made of its own batches, summed over the data-parallel ranks, on the device (a collective).
        Every process reads a batch; those that read the same one (tensor-parallel and pipeline peers) count it again:
        world / dp_size copies of each data-parallel rank's count."""
        device = self.engine.device
        total = all_reduce_small(torch.full((1,), n, dtype=torch.int64, device=device), torch.distributed.ReduceOp.SUM, device)
        return total[0] * self.engine.dp_size // self.world

    def _unscale_and_clip(self) -> torch.Tensor | None:
        """fp16: unscale the gradients first (the norm and the clip are in real units). The norm is needed to
        clip, and to skip non-finite steps (inf: measure without clipping)."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.grad_clip or (math.inf if self.cfg.max_skipped_steps else 0)
        return self.engine.clip_grad_norm(max_norm) if max_norm else None

    def _update(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, empty: torch.Tensor | None) -> None:
        scaler = self.precision.scaler
        # An fp16 overflow in the gradients is the scaler's to handle: only the loss is the guard's then.
        if not self.gate(loss_sum, None if scaler is not None else grad_norm):  # guards.py: skip a non-finite step
            return
        if scaler is None:
            if empty is None:
                self.engine.optimizer.step()
                return
            optimizer = self.optimizer
            optimizer.found_inf = empty.to(torch.float32)  # 1: the fused kernel leaves weights and moments as they were
            try:
                self.engine.optimizer.step()
            finally:
                del optimizer.found_inf
            return
        # The scale as a device tensor (a copy: update() lowers it in place on an overflow); get_scale() would read it.
        before = scaler._get_scale_async().clone()
        scaler.step(self.optimizer)
        scaler.update()
        self._scaler_skips.append(scaler._get_scale_async() < before)

    def settle(self, say: Callable[[str], None] | None = None) -> list[int]:
        """Read the verdicts of the steps since the last call, in one copy to the host (call it where the loop syncs
        anyway: log, checkpoint, end); add them to the counters. Returns the steps skipped with nothing to learn. A
        step with no token to learn is still a step of the schedule; the first one is `say`d, the rest are counted."""
        first = self.skipped_empty == 0
        flags = [f for _, f in self._empty if isinstance(f, torch.Tensor)] + self._scaler_skips
        read = iter(torch.stack([f.reshape(()).to(torch.int64) for f in flags]).tolist() if flags else [])
        empty = [number for number, f in self._empty if (f if isinstance(f, bool) else next(read))]
        self.skipped_by_scaler += sum(read)  # what is left: the scaler's verdicts
        self.skipped_empty += len(empty)
        self._empty, self._scaler_skips = [], []
        if empty and first and say is not None:
            say(f"notice: step {empty[0]} has no token to learn on any rank: skipped (no update); counted in skipped_empty_steps")
        return empty

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return torch_optimizer(self.engine.optimizer)

    def over_ranks(self, n: int) -> int:
        """A count each rank made of its own batches (throughput), summed over the data-parallel ranks, read on the host
        (log steps only). A collective."""
        return int(self._over_ranks(n))

    def mean_loss(self, result: StepResult) -> torch.Tensor:
        """The step's loss per valid token over all ranks, for logging. A collective."""
        mine = result.loss_sum.detach() if self.engine.loss_owner else torch.zeros((), device=result.loss_sum.device)
        total = all_reduce_small(mine.reshape(1).float(), torch.distributed.ReduceOp.SUM, self.engine.device)
        return total[0].cpu() / result.count.clamp(min=1).cpu()
