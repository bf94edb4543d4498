"""Executor 2: one pipeline stage per process, with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs).

The processes form the device mesh of parallel/mesh.py, dp_replicate x dp_shard x pp x tp: with tp = 1, global rank
r = dp_rank * S + pp_rank, so the stages of one replica are neighbouring ranks (one node when they fit).
Every rank builds the whole model on the meta device (shapes only), keeps its stages' parts (the others set to
None, so parameter names stay canonical) and gives memory and first values to those alone (parallel/model_init.py:
the same values whatever holds them); placement.py says which stages (one per rank; looped for the interleaved
schedules; V-shaped for zbv and dualpipev). With parallel.tp or parallel.dp_shard each stage is then cut like
a whole model in the mesh engine (parallel/sharding.py: the model's tensor-parallel plan, fully_shard per block):
pipelines compose with FSDP2, HSDP, tensor and context parallelism (parallel.cp: each stage's ranks hold T/cp of every
micro-batch, and the stages send that part). Under tensor parallelism a stage runs sequence parallel
as the whole model does (the plans hand on plain (B, T/tp, H) tensors between the regions, as torchtitan's do: a stage
sends and receives 1/tp of the sequence), and the last stage keeps the logits cut by vocabulary (loss parallel): the
forward, the loss and the backward all run inside `schedule.step`, so the step runs under torch's `loss_parallel`.

Gradient scaling, stated: each micro-batch's loss is its summed token loss times step.py's scale (data-parallel
ranks / the step's valid tokens), so the gradients add up to those of the per-token mean of the whole
optimizer step, exactly as in the unsplit model; the schedules' own scaling (scale_grads=True, a division by
the number of micro-batches) is therefore off. Gradient accumulation is more micro-batches in the same
schedule step (A x parallel.microbatches, as Megatron-LM counts them): one flush, and one gradient
reduction per optimizer step. Data parallelism over the replicas goes through FSDP2 on the data-parallel axes
(sharded stages, or plain replicas that FSDP2 keeps whole and all-reduces like DDP), which the schedule drives
itself (it reduces after the last micro-batch's backward); clipping uses the global norm: squared norms summed
over the stages.

The zero-bubble schedules (interleavedzb, zbv, dualpipev) split each backward into the input's gradient (B),
which the previous stage waits for, and the weights' gradient (W), which fills what would be bubble. A W comes after
other micro-batches' forwards, so an FSDP2 stage stays unsharded from its first forward to the step's end
(reshard_after_forward=False, as torchtitan keeps its stages; torch's PipelineStage keeps it so from the first backward
anyway): resharded after each forward, zbv over 2 FSDP2 replicas trained wrong (4.164 against 4.158 at step 2).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from parallel_train.checkpoint.named_state import RankState
from parallel_train.config.sections import Config
from parallel_train.core.collectives import gather_to_rank0
from parallel_train.data.batch import concat, named_inputs, parts, refuse_other_inputs
from parallel_train.errors import UserError
from parallel_train.losses import cross_entropy_sum, logits_of
from parallel_train.models.ties import find_ties
from parallel_train.parallel.context_parallel import on_mesh
from parallel_train.parallel.ddp_engine import OptimizerFactory
from parallel_train.parallel.mesh import MeshLayout, build_device_mesh, mesh_summary, share_line
from parallel_train.parallel.pipeline.balance import StageBalance
from parallel_train.parallel.pipeline.cost import measure_units
from parallel_train.parallel.pipeline.placement import V_SHAPED, forward_through, rank_of_stage, stages_of_rank, stages_per_rank
from parallel_train.parallel.pipeline.split import describe_stages, plan_stages, stage_module
from parallel_train.parallel.pipeline.tied import TiedAcrossStages
from parallel_train.parallel.pipeline.timeline import Clock, Recorder, write_report
from parallel_train.parallel.precision import Precision
from parallel_train.parallel.sharding import (
    clip_grad_norm,
    cuts_line,
    fsdp_wraps,
    gathered_logits_notice,
    local_numel,
    loss_context,
    parallelize,
    refuse_cut_ties,
    tensor_parallel_cuts,
)
from parallel_train.tasks.registry import task_of

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def check_layout(cfg: Config, world: int) -> tuple[int, int]:
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
    return V, world // (S * p.tp * p.cp)


def _contiguous_input_grads(module, args):
    """Stages send their input's gradient back to the previous rank, and gloo/NCCL send only contiguous
    tensors; some layers (a batch-first nn.GRU) produce a transposed gradient, so make it contiguous."""
    for x in args:
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(lambda grad: grad.contiguous())


class MultiProcessPipelineEngine:
    """Executor 2: the Engine protocol (parallel/engine.py); collectives run on every rank."""

    def __init__(
        self,
        cfg: Config,
        accelerator,
        model: nn.Module,
        init,
        make_optimizer: OptimizerFactory,
        precision: Precision,
        probe,
        layout: MeshLayout | None = None,
    ):
        p = cfg.parallel
        self.cfg, self.accelerator, self.precision = cfg, accelerator, precision
        self.loss_sum = task_of(cfg).loss_sum  # the task's loss (tasks/)
        self.device = accelerator.device
        world, rank = accelerator.num_processes, accelerator.process_index
        S, M, A = p.pipeline_stages, p.microbatches, cfg.train.gradient_accumulation_steps
        V, _ = check_layout(cfg, world)
        self.layout = layout = layout or MeshLayout(dp_replicate=world // S, pp=S)
        where = layout.coordinate(rank)
        # M: micro-batches per schedule step, every accumulation micro-step's (see the module docstring)
        self.S, self.M, self.V, self.world, self.rank = S, M * A, V, world, rank
        self.dp_size, self.dp_rank, self.pp_rank, self.tp_rank = layout.dp, layout.dp_rank(rank), where["pp"], where["tp"]
        self.leader = self.dp_rank == 0 and self.tp_rank == 0 and where["cp"] == 0  # reports this stage's timeline
        self._flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        total = sum(q.numel() for q in model.parameters())
        ties = find_ties(model)  # the whole model's, before any cut: a stage may hold only the alias (parallel/pipeline/tied.py)
        refuse_cut_ties(model, ties, layout.tp)
        # The whole model's cuts, every stage alike; a loss loss parallel cannot serve gets the logits gathered whole
        sequence_parallel, self.loss_parallel = tensor_parallel_cuts(model, layout.tp, cfg.model.block_size, self.loss_sum)
        self.notice = gathered_logits_notice(
            model, layout.tp, self.loss_parallel, max(1, cfg.train.batch_size // M), cfg.model.block_size // layout.cp
        )
        self.loss_sum = cross_entropy_sum if self.loss_parallel else self.loss_sum  # plain cross-entropy, on DTensor shards
        measure = measure_units(model, probe, self.device, init)
        plan = plan_stages(model, S * V, p.split, measure)
        self.inputs = named_inputs(model.forward)  # the batch's inputs every stage gets (positions, attention_mask, ...)
        self.stage_ids = stages_of_rank(self.pp_rank, S, V, p.schedule)  # the placement the schedule expects
        self.where = rank_of_stage(S, V, p.schedule)
        # One view holding all this rank's parts (names, optimizer, checkpoints) and one per stage (execution).
        self.local = stage_module(model, [n for i in self.stage_ids for n in plan[i]])
        self.stage_mods = [stage_module(model, plan[i]) for i in self.stage_ids]
        for mod in self.stage_mods:
            mod.register_forward_pre_hook(_contiguous_input_grads)

        mesh = build_device_mesh(layout, self.device.type)
        self.pp_group, self.cp = mesh.get_group("pp"), on_mesh(mesh, layout, rank, self.stage_mods)  # cp: stages hold T/cp
        # Each stage cut like a whole model: TP plan, compile per block, FSDP2 over the data-parallel replicas, or over
        # one rank under bf16/fp16, whose policy then computes the stage in bf16 (sharding.fsdp_wraps).
        policy = precision.fsdp_policy()
        wraps = fsdp_wraps(layout, policy is not None)
        for mod in self.stage_mods:
            self.compiled = parallelize(
                mod,
                mesh,
                layout,
                mp_policy=policy,
                compile=cfg.train.compile,
                shard_data_parallel=wraps,
                loss_parallel=self.loss_parallel,
                reshard_after_forward=False,  # zero-bubble W after later forwards needs its weights (module docstring)
            )
        self.autocast = not (wraps and policy is not None)  # FSDP2's policy already computes in bf16/fp16
        init.fill(self.local, self.device)  # parallel/model_init.py: only this rank's stages (its slices of them) get memory
        self.ties = ties
        self.tied = TiedAcrossStages(ties, plan, self.where, layout, rank, self.local)  # creates process groups: every rank
        self.optimizer = make_optimizer(self.local)
        self.params = [q for group in self.optimizer.param_groups for q in group["params"]]
        self.local_numel, self.model = local_numel(self.local), None  # forward runs through the stage views of self.local
        self.recorder, self.clock = Recorder(), Clock([self.device], host=time.time)  # wall clock: comparable across ranks
        self.profile_every = (10 if self.device.type == "cuda" else 1) if cfg.parallel.timeline else 0  # 0: never
        self._steps, self.profiling, self._stamps = 0, False, []
        self.is_first, self.is_last = 0 in self.stage_ids, (S * V - 1) in self.stage_ids
        self.loss_owner = self.is_last and self.tp_rank == 0
        self.balance = StageBalance.of(model, self.stage_mods, self.stage_ids, self, layout)  # MoE layers' loss (balance.py)
        self._scale, self._sums = torch.ones((), device=self.device), []  # this step's loss scale; its summed losses
        self.schedule = self._make_schedule(self.M, p.schedule, timed=True)
        self.name = self._banner(total, sequence_parallel)
        places = [f"rank {self.where[i]}" for i in range(S * V)]
        accelerator.print(f"[parallel_train] pipeline split: {describe_stages(model, plan, places, measure.seconds)}")

    def _banner(self, total: int, sequence_parallel: bool) -> str:
        p, S, V, A = self.cfg.parallel, self.S, self.V, self.cfg.train.gradient_accumulation_steps
        M, layout = p.microbatches, self.layout
        return (
            f"multi-process pipeline (executor 2, torch.distributed.pipelining): {S} stage ranks"
            + (f" x {V} {'V-shaped' if p.schedule in V_SHAPED else 'interleaved'} stages each" if V > 1 else "")
            + f", schedule {p.schedule}, {M} micro-batches"
            + (f" x {A} accumulation = {M * A} per step" if A > 1 else "")
            + f", {layout.dp} data-parallel replica{'s' if layout.dp > 1 else ''}; "
            + (f"stages computed in {self.precision.name} by FSDP2's policy (fp32 master weights); " if not self.autocast else "")
            + share_line(layout, self.local_numel, total)
            + cuts_line(sequence_parallel, self.loss_parallel)
        )

    def _make_schedule(self, n_microbatches: int, name: str, timed: bool = False):
        """Stages over this rank's modules and the named schedule (scale_grads=False: see the module docstring)."""
        from torch.distributed.pipelining import PipelineStage, schedules

        n = self.S * self.V
        stages = [
            PipelineStage(mod, i, n, self.device, group=self.pp_group) for mod, i in zip(self.stage_mods, self.stage_ids, strict=True)
        ]
        for stage in stages if self.balance is not None else ():  # the real forwards, not the shapes' inference
            stage.forward_one_chunk = self.balance.around(stage.forward_one_chunk)
        for stage in stages if timed else ():
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "F", stage.stage_index)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "B", stage.stage_index)
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, "W", stage.stage_index)
        schedule_cls = getattr(schedules, SCHEDULES[name])
        return schedule_cls(stages if self.V > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on the last stage, as backward sees it (see the module docstring)."""
        s = self.loss_sum(logits_of(out), y)
        self._sums.append(s.detach().full_tensor() if hasattr(s, "full_tensor") else s.detach())  # loss parallel's is a DTensor
        return self.precision.scale(s * self._scale)

    # ---- timing: one step in profile_every; on GPUs CUDA events around each chunk, read at the next timed step
    def _timed(self, fn, kind: str, stage_index: int):
        def wrapper(chunk_id, *args, **kwargs):
            if not self.profiling:
                return fn(chunk_id, *args, **kwargs)
            start = self.clock.now(self.device)
            result = fn(chunk_id, *args, **kwargs)
            self._stamps.append((stage_index, chunk_id, kind, start, self.clock.now(self.device)))
            return result

        return wrapper

    def _close_flush(self) -> None:
        """The stamps of the last timed flush as spans in wall-clock seconds (its events are done by the next one)."""
        stamps, self._stamps = self._stamps, []
        if not stamps:
            return
        at = lambda stamp: self.clock.t0 + self.clock.seconds(stamp, self.device)  # noqa: E731
        self.recorder.start_flush()
        for stage, chunk, kind, start, end in stamps:
            self.recorder.add(self.pp_rank, stage, chunk, kind, at(start), at(end))
        self.recorder.end_flush()

    def forward_backward(self, micro, scale: torch.Tensor, precision: Precision) -> torch.Tensor:
        """All micro-steps in one schedule step (A x M micro-batches): one flush, one gradient reduction."""
        if self.cp is not None:  # each rank its part of every sequence; FSDP2's average over the cp ranks made a sum
            micro, scale = [self.cp.cut_batch(b) for b in micro], scale * self.cp.size
        x, y, others = parts(concat(micro), self.device)
        refuse_other_inputs(others, f"the multi-process pipeline (parallel.pipeline_stages={self.S})", self.inputs)
        self._scale, self._sums = scale, []  # on this device already (step.py)
        self.profiling = bool(self.profile_every) and self._steps % self.profile_every == 0
        if self.profiling:
            self._close_flush()
            self.clock.start()  # on a GPU one wait for the device, on this timed step only
        args = (x,) if self.is_first else ()
        # The other inputs (a packed batch's positions, a padding mask) go to every stage, each cut into the same
        # micro-batches as the inputs: every pipeline rank reads the batch, and torch's schedules pass step()'s keyword
        # arguments to all stages.
        kwargs = {"target": y, "losses": []} if self.is_last else {}
        # loss_parallel: the last stage's loss and its backward run on vocabulary shards inside the step (every rank
        # enters it alike; it changes only the ops on vocabulary-cut DTensors)
        with precision.autocast(self.autocast), loss_context(self.loss_parallel):
            self.schedule.step(*args, **kwargs, **others, return_outputs=False)  # the losses are all it needs
        self.profiling = False
        self._steps += 1
        # The last M x A calls are the micro-batches: the schedule's first step also calls the loss once on an
        # uninitialised output, to infer the shapes of the gradients it will send.
        sums = self._sums[-self.M :]
        self.tied.sum_gradients()  # the copies of a tied weight on other stages' ranks: one gradient (parallel/pipeline/tied.py)
        return torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm: squared norms of every stage's gradients summed over the pipeline ranks (a tied weight once)."""
        return clip_grad_norm(self.params, max_norm, self.pp_group, self.tied.not_counted())

    def eval_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """Forward only through the stages (placement.forward_through); the last stage's tensor-parallel rank 0
        reports the logits, or under loss parallel each of its tensor-parallel ranks its slice of them, cut by
        vocabulary (the metrics run on the slices: parallel/vocab_metrics.py). kwargs (a packed batch's positions, a
        padding mask) go to every stage."""
        refuse_other_inputs(kwargs, f"the multi-process pipeline (parallel.pipeline_stages={self.S})", self.inputs)
        stages = dict(zip(self.stage_ids, self.stage_mods, strict=True))
        x = self.cp.cut(x) if self.cp is not None else x  # the stages send (B, T/cp, ...): the header says the shape
        with self.precision.autocast(self.autocast):
            logits = forward_through(stages, self.where, self.pp_rank, x, self.pp_group, self.device, kwargs)
        if logits is not None and self.cp is not None:  # the last stage's cp group: the whole sequence on its first
            logits = self.cp.gather(logits)
            logits = None if self.cp.rank else logits
        return logits if logits is not None and (self.tp_rank == 0 or self.loss_parallel) else None

    def set_training(self, on: bool) -> None:
        for mod in self.stage_mods:
            mod.train(on)

    # ---- state: this rank's stages under canonical names (its shards of sharded stages); replicas hold the same,
    # which checkpoints write once
    def rank_state(self) -> RankState:
        return RankState(self.local.state_dict(), self.local, self.optimizer, self.ties)

    def flops_per_token(self) -> int | None:
        return self._flops

    def finish(self, out: Path) -> dict:
        """Gather replica 0's measured timelines to rank 0, draw them, report the bubble. A collective."""
        self._close_flush()
        parts = [p for p in gather_to_rank0(self.recorder.steady() if self.leader else None) if p is not None]
        if self.rank != 0:
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
