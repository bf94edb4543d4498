"""Executor 2: one pipeline stage per process, with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs).

The processes form the device mesh of mesh.py, dp_replicate x dp_shard x pp x tp: with tp = 1, global rank
r = dp_rank * S + pp_rank, so the stages of one replica are neighbouring ranks (one node when they fit).
Every rank builds the whole model with the same seed and keeps its stages' parts (the others set to None, so
parameter names stay canonical); placement.py says which stages (one per rank; looped for the interleaved
schedules; V-shaped for zbv and dualpipev). With parallel.tp or parallel.dp_shard each stage is then cut like
a whole model in the mesh engine (sharding.py: the model's tensor-parallel plan, fully_shard per block):
pipelines compose with FSDP2, HSDP and tensor parallelism.

Gradient scaling, stated: our loss is a mean per micro-batch. The schedules' own scaling
(scale_grads=True) divides ALL gradients by M at the end of every `step`, which would also shrink the
gradients accumulated by earlier accumulation micro-steps. So we pass scale_grads=False and scale the
loss instead: each micro-batch's loss is multiplied by 1/(M*A) (A = gradient_accumulation_steps), so the
gradients add up to those of the mean loss over the whole optimizer step, exactly as in the unsplit model.
Data parallelism then averages the gradients over the data-parallel ranks (FSDP2 does it when the stages are
sharded, else a manual all-reduce once per optimizer step), and clipping uses the global norm: squared
norms summed over the stages.

The zero-bubble schedules (interleavedzb, zbv, dualpipev) split each backward into the input's gradient (B),
which the previous stage waits for, and the weights' gradient (W), which fills what would be bubble.
"""

from __future__ import annotations

import math
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
from parallel_train.mesh import MeshLayout, build_device_mesh, mesh_summary, share_line
from parallel_train.pipeline.cost import measure_units
from parallel_train.pipeline.placement import V_SHAPED, forward_through, rank_of_stage, stages_of_rank, stages_per_rank
from parallel_train.pipeline.split import describe_stages, plan_stages, stage_module
from parallel_train.pipeline.timeline import Recorder, write_report
from parallel_train.sharding import clip_grad_norm, local_numel, parallelize, retarget_optimizer

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def check_layout(cfg: Config, world: int, precision: str) -> tuple[int, int]:
    """(stages per rank V, data-parallel replicas D), or a one-line error."""
    p = cfg.parallel
    S, M = p.pipeline_stages, p.microbatches
    if world % S:
        raise UserError(
            f"parallel.pipeline_stages={S} does not divide the world size {world}; launch a multiple of {S} processes "
            f"(stages x data-parallel replicas), e.g. torchrun --nproc-per-node {S} train.py ..."
        )
    V = stages_per_rank(p.schedule, p.stages_per_rank)
    if p.schedule in ("interleaved1f1b", "interleavedzb") and V < 2:
        raise UserError(f"parallel.stages_per_rank: {p.schedule} needs at least 2 stages per rank; set parallel.stages_per_rank=2")
    if p.schedule in V_SHAPED and p.stages_per_rank != 2:
        raise UserError(f"parallel.stages_per_rank={p.stages_per_rank}: {p.schedule} places exactly 2 stages per rank (a V); set it to 2")
    if cfg.train.batch_size % M:
        raise UserError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by parallel.microbatches={M}; "
            "the micro-batches must be equal for the mean loss to match the unsplit model"
        )
    if p.schedule == "1f1b" and M < S:
        raise UserError(
            f"parallel.microbatches={M}: 1f1b needs at least one micro-batch per stage ({S}); "
            "raise parallel.microbatches or use parallel.schedule=gpipe"
        )
    least = {"zbv": 2 * S - 1, "dualpipev": 2 * S}.get(p.schedule, 0)
    if M < least:
        raise UserError(f"parallel.microbatches={M}: {p.schedule} needs at least {least} micro-batches with {S} pipeline ranks")
    if p.schedule in ("interleaved1f1b", "interleavedzb") and M % max(1, M // S):
        raise UserError(
            f"parallel.microbatches={M}: {p.schedule} needs a multiple of parallel.pipeline_stages={S} (or fewer micro-batches than stages)"
        )
    if precision == "fp16":
        raise UserError("mixed precision fp16 is not supported by the multi-process pipeline (no loss scaling there); use bf16")
    return V, world // (S * p.tp)


def _contiguous_input_grads(module, args):
    """Stages send their input's gradient back to the previous rank, and gloo/NCCL send only contiguous
    tensors; some layers (a batch-first nn.GRU) produce a transposed gradient, so make it contiguous."""
    for x in args:
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(lambda grad: grad.contiguous())


class MultiProcessPipelineEngine:
    """Executor 2: the same methods as DataParallelEngine; collectives run on every rank."""

    def __init__(
        self, cfg: Config, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, val_loader, layout: MeshLayout | None = None
    ):
        p = cfg.parallel
        self.cfg, self.accelerator, self.optimizer, self.val_loader = cfg, accelerator, optimizer, val_loader
        self.device = accelerator.device
        world, rank = accelerator.num_processes, accelerator.process_index
        S, M, A = p.pipeline_stages, p.microbatches, cfg.train.gradient_accumulation_steps
        V, _ = check_layout(cfg, world, accelerator.mixed_precision)
        self.layout = layout = layout or MeshLayout(dp_replicate=world // S, pp=S)
        where = layout.coordinate(rank)
        self.S, self.M, self.V, self.world, self.rank = S, M, V, world, rank
        self.dp_size, self.dp_rank, self.pp_rank, self.tp_rank = layout.dp, layout.dp_rank(rank), where["pp"], where["tp"]
        self.leader = self.dp_rank == 0 and self.tp_rank == 0  # reports this stage's timeline

        if cfg.train.compile:
            accelerator.print("notice: train.compile is not applied to pipeline stages; training uncompiled")
        self._flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        total, names = sum(q.numel() for q in model.parameters()), {id(q): n for n, q in model.named_parameters()}
        measure = measure_units(model, val_loader, self.device)
        plan = plan_stages(model, S * V, p.split, measure)
        self.stage_ids = stages_of_rank(self.pp_rank, S, V, p.schedule)  # the placement the schedule expects
        self.where = rank_of_stage(S, V, p.schedule)
        # One view holding all this rank's parts (names, optimizer, checkpoints) and one per stage (execution).
        self.local = stage_module(model, [n for i in self.stage_ids for n in plan[i]])
        self.stage_mods = [stage_module(model, plan[i]) for i in self.stage_ids]
        for mod in self.stage_mods:
            mod.register_forward_pre_hook(_contiguous_input_grads)
        mine = {id(q) for q in self.local.parameters()}
        for group in optimizer.param_groups:  # in place: the LR scheduler holds this optimizer
            group["params"] = [q for q in group["params"] if id(q) in mine]

        mesh = build_device_mesh(layout, self.device.type)
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp_replicate")
        if layout.sharded:  # each stage cut like a whole model: TP plan, then fully_shard (FSDP2 averages over dp)
            for mod in self.stage_mods:
                parallelize(mod, mesh, layout)
        self.local.to(self.device)
        retarget_optimizer(optimizer, names, self.local)
        self.params = [q for group in optimizer.param_groups for q in group["params"]]
        self.local_numel = local_numel(self.local)
        self.update_allowed = allow_every_update  # the trainer installs its guard here
        self.model = None  # forward runs through the stage views of self.local (no one module to hook)
        self.recorder = Recorder()
        self.profile_every = 10 if self.device.type == "cuda" else 1
        self._steps, self.profiling = 0, False
        self.is_first, self.is_last = 0 in self.stage_ids, (S * V - 1) in self.stage_ids
        self.loss_scale = 1.0 / (M * A)
        self.schedule = self._make_schedule(M, p.schedule, timed=True)

        self.name = (
            f"multi-process pipeline (executor 2, torch.distributed.pipelining): {S} stage ranks"
            + (f" x {V} {'V-shaped' if p.schedule in V_SHAPED else 'interleaved'} stages each" if V > 1 else "")
            + f", schedule {p.schedule}, {M} micro-batches, {layout.dp} data-parallel replica{'s' if layout.dp > 1 else ''}; "
            + share_line(layout, self.local_numel, total)
        )
        places = [f"rank {self.where[i]}" for i in range(S * V)]
        accelerator.print(f"[parallel_train] pipeline split: {describe_stages(model, plan, places, measure.seconds)}")

    def _make_schedule(self, n_microbatches: int, name: str, timed: bool = False):
        """Stages over this rank's modules and the named schedule (scale_grads=False: see the module docstring)."""
        from torch.distributed.pipelining import PipelineStage, schedules

        n = self.S * self.V
        stages = [
            PipelineStage(mod, i, n, self.device, group=self.pp_group) for mod, i in zip(self.stage_mods, self.stage_ids, strict=True)
        ]
        for stage in stages if timed else ():
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "F", stage.stage_index)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "B", stage.stage_index)
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, "W", stage.stage_index)
        schedule_cls = getattr(schedules, SCHEDULES[name])
        scaled_loss = lambda out, y: loss_fn(out, y) * self.loss_scale  # noqa: E731 (see the module docstring)
        return schedule_cls(stages if self.V > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False)

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
        if self.dp_size > 1 and not self.layout.sharded:  # plain replicas: average their gradients (FSDP2 does it itself)
            grads = [q.grad for q in self.params if q.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.dp_size)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)
        grad_norm = None
        if self.cfg.train.grad_clip > 0 or self.cfg.train.max_skipped_steps:
            grad_norm = clip_grad_norm(self.params, self.cfg.train.grad_clip or float("inf"), self.pp_group)
        # The guard (guards.py) sees the global norm, the same on every rank: all skip a non-finite step together.
        if self.update_allowed(loss, grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, tokens

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks of the last stage's loss (other stages add zero; the tensor-parallel
        ranks of a stage hold the same loss). A collective."""
        total = loss.detach().clone() if self.is_last else torch.zeros((), device=self.device)
        dist.all_reduce(total)
        return total / (self.dp_size * self.layout.tp)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation metrics (eval_metrics.py) over the fixed eval batches, which the data-parallel ranks take
        in turn, forward only through the stages (placement.forward_through). With sharded stages every forward
        is a collective, so every rank runs as many: past the end it repeats batch 0 and counts nothing."""
        for mod in self.stage_mods:
            mod.eval()
        batches = list(self.val_loader)
        stages = dict(zip(self.stage_ids, self.stage_mods, strict=True))
        totals = None
        for k in range(math.ceil(len(batches) / self.dp_size)):
            i = k * self.dp_size + self.dp_rank
            x, y = batches[i] if i < len(batches) else batches[0]
            with self.accelerator.autocast():
                logits = forward_through(stages, self.where, self.pp_rank, x, self.pp_group, self.device)
            if logits is not None and i < len(batches) and self.tp_rank == 0:
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

    # ---- state: this rank's stages under canonical names (its shards of sharded stages); replicas hold the same,
    # which checkpoints write once
    def rank_state(self) -> RankState:
        return RankState(self.local.state_dict(), self.local, self.optimizer)

    def _gather(self, obj: Any) -> list[Any] | None:
        parts = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj if self.leader else None, parts, dst=0)
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
            f"rank {r}"
            + (
                f" (stages {', '.join(str(s) for s in stages_of_rank(r, self.S, self.V, self.cfg.parallel.schedule))})"
                if self.V > 1
                else ""
            )
            for r in range(self.S)
        ]
        title = f"multi-process pipeline: {self.S} ranks, schedule {self.cfg.parallel.schedule}, {self.M} micro-batches"
        report = write_report(flushes, labels, self.M, self.V, out, title, self.accelerator.print, self.cfg.parallel.schedule)
        return {**mesh_summary(self.layout, self.local_numel), **report}
