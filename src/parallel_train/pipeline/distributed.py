"""Executor 2: one pipeline stage per process, with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs).

World size = pipeline_stages x data-parallel replicas, laid out as a (dp, pp) mesh: global rank
r = dp_rank * S + pp_rank, so the stages of one replica are neighbouring ranks (one node when they fit).
Every rank builds the whole model with the same seed, keeps its stage's parts (the others set to None,
so parameter names stay canonical) and moves them to its device. The interleaved schedule gives each
rank V > 1 stages, looped: rank k holds stages k, k+S, k+2S, ...

Gradient scaling, stated: our loss is a mean per micro-batch. The schedules' own scaling
(scale_grads=True) divides ALL gradients by M at the end of every `step`, which would also shrink the
gradients accumulated by earlier accumulation micro-steps. So we pass scale_grads=False and scale the
loss instead: each micro-batch's loss is multiplied by 1/(M*A) (A = gradient_accumulation_steps), so the
gradients add up to those of the mean loss over the whole optimizer step, exactly as in the unsplit model.
Data parallelism then averages the gradients over the dp group (a manual all-reduce, once per optimizer
step), and clipping uses the global norm: squared norms summed over the pp group.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.config import Config
from parallel_train.engine import RankState, allow_every_update
from parallel_train.errors import UserError
from parallel_train.eval_metrics import add_stats, add_totals, metric_stats, metric_values
from parallel_train.losses import loss_fn
from parallel_train.pipeline.cost import measure_units
from parallel_train.pipeline.split import describe_stages, plan_stages, stage_module
from parallel_train.pipeline.timeline import Recorder, write_report

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B"}


def check_layout(cfg: Config, world: int, precision: str) -> tuple[int, int]:
    """(stages per rank V, data-parallel replicas D), or a one-line error."""
    p = cfg.parallel
    S = p.pipeline_stages
    if world % S:
        raise UserError(
            f"parallel.pipeline_stages={S} does not divide the world size {world}; launch a multiple of {S} processes "
            f"(stages x data-parallel replicas), e.g. torchrun --nproc-per-node {S} train.py ..."
        )
    V = p.stages_per_rank if p.schedule == "interleaved1f1b" else 1
    if V < 2 and p.schedule == "interleaved1f1b":
        raise UserError("parallel.stages_per_rank: interleaved1f1b needs at least 2 stages per rank; set parallel.stages_per_rank=2")
    if cfg.train.batch_size % p.microbatches:
        raise UserError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by parallel.microbatches={p.microbatches}; "
            "the micro-batches must be equal for the mean loss to match the unsplit model"
        )
    if p.schedule == "1f1b" and p.microbatches < S:
        raise UserError(
            f"parallel.microbatches={p.microbatches}: 1f1b needs at least one micro-batch per stage ({S}); "
            "raise parallel.microbatches or use parallel.schedule=gpipe"
        )
    if p.schedule == "interleaved1f1b" and p.microbatches % max(1, p.microbatches // S):
        raise UserError(
            f"parallel.microbatches={p.microbatches}: interleaved1f1b needs a multiple of parallel.pipeline_stages={S} "
            f"(or fewer micro-batches than stages)"
        )
    if precision == "fp16":
        raise UserError("mixed precision fp16 is not supported by the multi-process pipeline (no loss scaling there); use bf16")
    return V, world // S


def _contiguous_input_grads(module, args):
    """Stages send their input's gradient back to the previous rank, and gloo/NCCL send only contiguous
    tensors; some layers (a batch-first nn.GRU) produce a transposed gradient, so make it contiguous."""
    for x in args:
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(lambda grad: grad.contiguous())


class MultiProcessPipelineEngine:
    """Executor 2: the same methods as DataParallelEngine; collectives run on every rank."""

    def __init__(self, cfg: Config, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, val_loader):
        from torch.distributed.device_mesh import init_device_mesh

        p = cfg.parallel
        self.cfg, self.accelerator, self.optimizer, self.val_loader = cfg, accelerator, optimizer, val_loader
        self.device = accelerator.device
        world, rank = accelerator.num_processes, accelerator.process_index
        S, M, A = p.pipeline_stages, p.microbatches, cfg.train.gradient_accumulation_steps
        V, D = check_layout(cfg, world, accelerator.mixed_precision)
        self.S, self.M, self.V, self.world, self.rank = S, M, V, world, rank
        self.dp_size, self.dp_rank, self.pp_rank = D, rank // S, rank % S

        if cfg.train.compile:
            accelerator.print("notice: train.compile is not applied to pipeline stages; training uncompiled")
        self._flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        measure = measure_units(model, val_loader, self.device)
        plan = plan_stages(model, S * V, p.split, measure)
        self.stage_ids = [self.pp_rank + k * S for k in range(V)]  # looped placement, as the schedules expect
        # One view holding all this rank's parts (names, optimizer, checkpoints) and one per stage (execution).
        self.local = stage_module(model, [n for i in self.stage_ids for n in plan[i]]).to(self.device)
        self.stage_mods = [stage_module(model, plan[i]) for i in self.stage_ids]
        for mod in self.stage_mods:
            mod.register_forward_pre_hook(_contiguous_input_grads)
        mine = {id(q) for q in self.local.parameters()}
        for group in optimizer.param_groups:  # in place: the LR scheduler holds this optimizer
            group["params"] = [q for q in group["params"] if id(q) in mine]

        mesh = init_device_mesh(self.device.type, (D, S), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.update_allowed = allow_every_update  # the trainer installs its guard here
        self.model = None  # forward runs through the stage views of self.local (no one module to hook)
        self.recorder = Recorder()
        self.profile_every = 10 if self.device.type == "cuda" else 1
        self._steps, self.profiling = 0, False
        self.is_first, self.is_last = 0 in self.stage_ids, (S * V - 1) in self.stage_ids
        self.loss_scale = 1.0 / (M * A)
        self.schedule = self._make_schedule(M, p.schedule, timed=True)
        self.eval_schedule = None  # built at the first evaluation: its batches may have another size

        self.name = (
            f"multi-process pipeline (executor 2, torch.distributed.pipelining): {S} stage ranks"
            + (f" x {V} interleaved stages each" if V > 1 else "")
            + f", schedule {p.schedule}, {M} micro-batches, "
            f"{D} data-parallel replica{'s' if D > 1 else ''}"
        )
        places = [f"rank {i % S}" for i in range(S * V)]
        accelerator.print(f"[parallel_train] pipeline split: {describe_stages(model, plan, places, measure.seconds)}")

    def _make_schedule(self, n_microbatches: int, name: str, timed: bool = False, loss: bool = True):
        """Stages over this rank's modules and the named schedule. Stages learn the activation shapes at
        their first step, so evaluation (another batch size) gets its own."""
        from torch.distributed.pipelining import PipelineStage, schedules

        n = self.S * self.V
        stages = [
            PipelineStage(mod, i, n, self.device, group=self.pp_group) for mod, i in zip(self.stage_mods, self.stage_ids, strict=True)
        ]
        for stage in stages if timed else ():
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "F", stage.stage_index)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "B", stage.stage_index)
        schedule_cls = getattr(schedules, SCHEDULES[name])
        scaled_loss = lambda out, y: loss_fn(out, y) * self.loss_scale  # noqa: E731 (see the module docstring)
        return schedule_cls(
            stages if self.V > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss if loss else None, scale_grads=False
        )

    # ---- timing
    def _timed(self, fn, kind: str, stage_index: int):
        def wrapper(chunk_id, *args, **kwargs):
            if not self.profiling:
                return fn(chunk_id, *args, **kwargs)
            t0 = time.time()  # wall clock: comparable across processes (and NTP-synced nodes)
            result = fn(chunk_id, *args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.recorder.add(self.pp_rank, stage_index, chunk_id, kind, t0, time.time())
            return result

        return wrapper

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """One training pass of all micro-batches through the pipeline. Returns the scaled micro-batch losses (last stage)."""
        losses: list[torch.Tensor] = []
        args = (x.to(self.device),) if self.is_first else ()
        kwargs = {"target": y.to(self.device), "losses": losses} if self.is_last else {}
        with self.accelerator.autocast():
            self.schedule.step(*args, **kwargs, return_outputs=False)  # the losses are all it needs
        return losses

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        A = self.cfg.train.gradient_accumulation_steps
        self.loss_scale = 1.0 / (self.M * A)
        loss = torch.zeros((), device=self.device)
        tokens = 0
        for _ in range(A):
            x, y = next(batches)
            self.profiling = self._steps % self.profile_every == 0
            if self.profiling:
                self.recorder.start_flush()
            for micro_loss in self._run(x, y):
                loss += micro_loss.detach()  # scaled by 1/(M*A): the sum is the step's mean loss
            self.recorder.end_flush()
            self.profiling = False
            tokens += y.numel()
        self._steps += 1
        params = [q for q in self.local.parameters() if q.grad is not None]
        if self.dp_size > 1 and params:
            grads = [q.grad for q in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.dp_size)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)
        grad_norm = None
        if self.cfg.train.grad_clip > 0 or self.cfg.train.max_skipped_steps:
            grad_norm = self._clip(params, self.cfg.train.grad_clip or float("inf"))
        # The guard (guards.py) sees the global norm, the same on every rank: all skip a non-finite step together.
        if self.update_allowed(loss, grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, tokens

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the squared norms of all stages add up."""
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for q in params:
            sq += q.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for q in params:
            q.grad.mul_(coef.to(q.grad.dtype))
        return norm

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over replicas of the last stage's loss (other stages add zero). A collective."""
        total = loss.detach().clone() if self.is_last else torch.zeros((), device=self.device)
        dist.all_reduce(total)
        return total / self.dp_size

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation metrics (eval_metrics.py); the replicas take turns over the fixed eval batches, and each
        replica's last stage computes them from the logits."""
        for mod in self.stage_mods:
            mod.eval()
        if self.eval_schedule is None:
            size = len(next(iter(self.val_loader))[0])  # every eval batch has this size
            self.eval_m = max(m for m in range(1, min(self.M, size) + 1) if size % m == 0 and m % max(1, m // self.S) == 0)
            # Forward only: every schedule runs the same forwards; gpipe takes any number of micro-batches.
            self.eval_schedule = self._make_schedule(self.eval_m, "interleaved1f1b" if self.V > 1 else "gpipe", loss=False)
        totals = None
        for i, (x, y) in enumerate(self.val_loader):
            if i % self.dp_size != self.dp_rank:
                continue
            with self.accelerator.autocast():
                logits = self.eval_schedule.eval(*((x.to(self.device),) if self.is_first else ()))
            if self.is_last:
                totals = add_stats(totals, metric_stats(logits, y))
        for mod in self.stage_mods:
            mod.train()
        # The sums live on the last stage of each replica: every rank gathers them (a few numbers per metric).
        parts: list[dict | None] = [None] * self.world
        dist.all_gather_object(parts, {k: v.cpu() for k, v in totals.items()} if totals is not None else None)
        summed = None
        for part in filter(None, parts):
            summed = add_totals(summed, part)
        return metric_values(summed)

    # ---- state: this rank's stages under canonical names; replicas hold the same, which checkpoints write once
    def rank_state(self) -> RankState:
        return RankState(self.local.state_dict(), self.local, self.optimizer)

    def _gather(self, obj: Any) -> list[Any] | None:
        parts = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj if self.dp_rank == 0 else None, parts, dst=0)
        return [q for q in parts if q is not None] if parts is not None else None

    def flops_per_token(self) -> int | None:
        return self._flops

    def finish(self, out: Path) -> dict:
        """Gather replica 0's measured timelines to rank 0, draw them, report the bubble. A collective."""
        parts = self._gather(self.recorder.steady())
        if parts is None:
            return {}
        n = min(len(p) for p in parts)
        flushes = [sorted(s for p in parts for s in p[len(p) - n + k]) for k in range(n)]
        labels = [
            f"rank {r}" + (f" (stages {', '.join(str(r + k * self.S) for k in range(self.V))})" if self.V > 1 else "")
            for r in range(self.S)
        ]
        title = f"multi-process pipeline: {self.S} ranks, schedule {self.cfg.parallel.schedule}, {self.M} micro-batches"
        return write_report(flushes, labels, self.M, self.V, out, title, self.accelerator.print)
