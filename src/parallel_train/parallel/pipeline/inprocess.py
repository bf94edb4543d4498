"""Executor 1: one process drives a model split over several devices (the classic two-GPU recipe, pipelined).

The model stays ONE object: each stage's modules move to the stage's device and a forward pre-hook
moves the incoming activations there, so parameter names (and checkpoints) are the unsplit model's.
`PipelineModule` cuts each batch into M micro-batches and runs them one after another (GPipe
fill-drain): on GPUs the kernel launches are asynchronous, so while stage 1 computes micro-batch i,
stage 0 already computes micro-batch i+1. The backward of the summed loss then runs the stages
concurrently too (autograd has one worker thread per GPU). On CPU all stages share the same cores:
nothing overlaps, which the timeline picture shows honestly.

Everything else is the data-parallel engine: Accelerate (device placement off), DDP over processes
(each process owns one pipeline over its own devices), mixed precision, accumulation, clipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from parallel_train.config.sections import Config
from parallel_train.data.batch import named_inputs, refuse_other_inputs
from parallel_train.errors import UserError
from parallel_train.models.ties import describe, find_ties, tie_groups
from parallel_train.parallel.ddp_engine import DataParallelEngine, OptimizerFactory
from parallel_train.parallel.mesh import mesh_summary
from parallel_train.parallel.model_init import Whole
from parallel_train.parallel.parts import model_units
from parallel_train.parallel.pipeline.cost import measure_units
from parallel_train.parallel.pipeline.split import describe_stages, plan_stages
from parallel_train.parallel.pipeline.tied import stages_holding
from parallel_train.parallel.pipeline.timeline import Clock, Recorder, write_report
from parallel_train.parallel.precision import Precision
from parallel_train.parallel.router_balance import moe_layers


def resolve_devices(names: list[str], local_rank: int) -> list[torch.device]:
    """Parse stage devices and check they exist. With several processes per machine, process r uses
    the next group of GPUs: stage_devices=[cuda:0,cuda:1] means cuda:2, cuda:3 for local rank 1."""
    devices = []
    for name in names:
        try:
            devices.append(torch.device(name))
        except RuntimeError:
            raise UserError(f"parallel.stage_devices: {name!r} is not a device; use cpu or cuda:N") from None
    cuda_indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    out = []
    for d in devices:
        if d.type == "cuda":
            index = (d.index or 0) + local_rank * len(cuda_indices)
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= visible:
                where = f"for local process {local_rank} " if local_rank else ""
                raise UserError(
                    f"parallel.stage_devices: cuda:{index} {where}does not exist ({visible} CUDA devices visible); "
                    "list devices that exist, e.g. [cpu,cpu] on a machine without GPUs"
                )
            d = torch.device("cuda", index)
        elif d.type != "cpu":
            try:
                torch.empty(0, device=d)
            except (RuntimeError, AssertionError):
                raise UserError(f"parallel.stage_devices: device {str(d)!r} is not available here; use cpu or cuda:N") from None
        out.append(d)
    return out


def refuse_ties_across_devices(ties: dict[str, str], stages: list[list[str]], devices: list[torch.device]) -> None:
    """A tied weight (models/ties.py) is one tensor in this one process: its stages must share a device. (On several
    devices it would need a copy per device and summed gradients, as executor 2 does across processes.)"""
    for names in tie_groups(ties).values():
        where = {devices[s] for s in stages_holding(names, stages)}
        if len(where) > 1:
            raise UserError(
                f"parallel.stage_devices: {describe({n: names[0] for n in names[1:]})} (tied weights), and its stages "
                f"run on {', '.join(sorted(map(str, where)))}; put those stages on one device, or launch one process per "
                "stage (no parallel.stage_devices), which keeps a tie across stages"
            )


class PipelineModule(nn.Module):
    """`model` split over `devices`, fed in micro-batches: forward(x) -> logits on the last device."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[list[str]],
        devices: list[torch.device],
        microbatches: int,
        recorder: Recorder,
        profile_every: int = 1,
    ):
        super().__init__()
        self.model, self.devices, self.microbatches = model, devices, microbatches
        self.inputs = named_inputs(model.forward)  # the batch's inputs every stage gets (positions, attention_mask, ...)
        self.recorder, self.profile_every, self.clock = recorder, profile_every, Clock(devices)
        self._mb, self._flushes, self._stamps, self.profiling = 0, 0, [], False
        units = model_units(model)
        for s, (names, device) in enumerate(zip(stages, devices, strict=True)):
            for name in names:
                units[name].to(device)
                units[name].register_forward_pre_hook(self._mover(device))
            first, last = units[names[0]], units[names[-1]]
            first.register_forward_pre_hook(self._stage_start(s, device))
            first.register_forward_hook(self._stage_first_out(s, device))
            last.register_forward_hook(self._stage_end(s, device))

    # ---- hooks: activations to the stage's device; forward/backward spans for the timeline
    @staticmethod
    def _mover(device: torch.device):
        def hook(module, args):
            return tuple(a.to(device) if torch.is_tensor(a) and a.device != device else a for a in args)

        return hook

    def _stamp(self, stage: int, mb: int, what: str, device: torch.device) -> None:
        self._stamps.append((stage, mb, what, self.clock.now(device), device))

    def _stage_start(self, stage: int, device: torch.device):
        def hook(module, args):
            if self.profiling:
                mb = self._mb
                self._stamp(stage, mb, "F0", device)
                for a in args:  # the gradient reaching the stage's input ends its backward
                    if torch.is_tensor(a) and a.requires_grad:
                        a.register_hook(lambda g, mb=mb: self._stamp(stage, mb, "B1", device))

        return hook

    def _stage_first_out(self, stage: int, device: torch.device):
        def hook(module, args, output):
            # A stage whose input needs no gradient (token ids): its backward ends at its first module's output.
            if self.profiling and not any(torch.is_tensor(a) and a.requires_grad for a in args) and output.requires_grad:
                output.register_hook(lambda g, mb=self._mb: self._stamp(stage, mb, "B1", device))

        return hook

    def _stage_end(self, stage: int, device: torch.device):
        def hook(module, args, output):
            if self.profiling:
                self._stamp(stage, self._mb, "F1", device)
                if output.requires_grad:
                    output.register_hook(lambda g, mb=self._mb: self._stamp(stage, mb, "B0", device))

        return hook

    def _close_flush(self) -> None:
        """Turn the stamps of the finished flush (forward and backward) into spans."""
        stamps, self._stamps = self._stamps, []
        if not stamps:
            return
        times = {(s, mb, what): self.clock.seconds(t, d) for s, mb, what, t, d in stamps}
        self.recorder.start_flush()
        for (s, mb, what), t0 in times.items():
            end = times.get((s, mb, what[0] + "1"))
            if what in ("F0", "B0") and end is not None:
                self.recorder.add(s, s, mb, what[0], t0, end)
        self.recorder.end_flush()

    def finish_profile(self) -> None:
        self._close_flush()

    def forward(self, x: torch.Tensor, **others: torch.Tensor) -> torch.Tensor:
        """`others`: a packed batch's positions, a dict batch's other inputs (data/batch.py), each cut into the same
        micro-batches as the inputs and given to the model (every stage), if its forward names them; else one line."""
        refuse_other_inputs(others, "the one-process pipeline (parallel.stage_devices)", self.inputs)
        training = self.training and torch.is_grad_enabled()
        if training:
            self.profiling = bool(self.profile_every) and self._flushes % self.profile_every == 0  # 0: never
            self._flushes += 1
            if self.profiling:  # the last timed flush is read now, not at the step after it: on GPUs no wait between
                self._close_flush()
                self.clock.start()
        else:
            self.profiling = False  # evaluation is not part of the schedule picture
        x = x.to(self.devices[0], non_blocking=True)  # device to device (the batch came to the last stage's): no host wait
        chunks = torch.tensor_split(x, self.microbatches)
        split = {k: torch.tensor_split(v, self.microbatches) for k, v in others.items()}
        kwargs = [{k: v[mb] for k, v in split.items()} for mb in range(len(chunks))]
        outputs = []
        for mb, (chunk, kw) in enumerate(zip(chunks, kwargs, strict=True)):
            self._mb = mb
            outputs.append(self.model(chunk, **kw))
        return torch.cat(outputs)


class InProcessPipelineEngine(DataParallelEngine):
    """Executor 1: the data-parallel engine over a PipelineModule (device placement off: the stages stay put)."""

    def __init__(self, cfg: Config, accelerator, model: nn.Module, init, make_optimizer: OptimizerFactory, precision: Precision, probe):
        p = cfg.parallel
        if p.schedule != "gpipe":
            raise UserError(
                f"parallel.schedule={p.schedule}: the one-process executor (parallel.stage_devices given) runs gpipe; "
                "drop stage_devices and launch one process per stage for 1f1b or interleaved1f1b"
            )
        if cfg.train.batch_size < p.microbatches:
            raise UserError(
                f"parallel.microbatches={p.microbatches} is more than train.batch_size={cfg.train.batch_size}; "
                "use at most one micro-batch per sample"
            )
        if moe_layers(model, tap=False):  # the GPT's are refused with the config (config/load.py), a transformers MoE's here
            raise UserError(
                "parallel.stage_devices: a mixture of experts: the in-process pipeline does not carry the router's balancing "
                "loss; leave parallel.stage_devices empty and launch one process per stage"
            )
        devices = resolve_devices(p.stage_devices, accelerator.local_process_index)
        init.fill(model, torch.device("cpu"))  # one process holds every stage: the whole model, then each stage moves
        measure = measure_units(model, probe, devices[0], Whole())
        stages = plan_stages(model, len(devices), p.split, measure)
        refuse_ties_across_devices(find_ties(model), stages, devices)
        self.base, self.stages, self.devices = model, stages, devices
        self.recorder = Recorder()
        # On GPUs a timed flush waits for the devices once (the clock's anchor): time one flush in ten there, none
        # without parallel.timeline.
        every = (10 if any(d.type == "cuda" for d in devices) else 1) if p.timeline else 0
        self.pipe = PipelineModule(model, stages, devices, p.microbatches, self.recorder, profile_every=every)
        if accelerator.num_processes > 1:
            # Accelerate refuses (or pins DDP to one GPU for) a model spread over devices unless told to
            # let it be; DDP then syncs the gradients of the multi-device module (device_ids=None).
            os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
        # Not the pipe as a whole: its hooks move activations between devices and time the stages.
        super().__init__(cfg, accelerator, self.pipe, lambda _: make_optimizer(model), precision, device_placement=False, compile=False)
        if cfg.train.compile:
            for names in stages:  # each stage's units compiled on their own, on the stage's device
                for name in names:
                    model_units(model)[name].compile()
            self.compiled = f"each unit of the {len(stages)} stages on its own (torch.compile)"
        self.device = devices[-1]  # targets meet the logits on the last stage
        # The mesh counts processes: each holds every stage (on its own devices), one data-parallel replica.
        self.name = (
            f"pipeline in one process (executor 1): {len(devices)} stages on {', '.join(map(str, devices))}, "
            f"GPipe fill-drain over {p.microbatches} micro-batches"
            + (f", x {accelerator.num_processes} DDP replicas" if accelerator.num_processes > 1 else "")
        )
        accelerator.print(f"[parallel_train] pipeline split: {describe_stages(model, stages, devices, measure.seconds)}")

    @property
    def unwrapped(self) -> nn.Module:
        return self.base

    def finish(self, out: Path) -> dict:
        self.pipe.finish_profile()
        if not self.accelerator.is_main_process:
            return {}
        labels = [f"stage {s} on {d}" for s, d in enumerate(self.devices)]
        title = f"in-process pipeline: {len(self.devices)} stages, {self.cfg.parallel.microbatches} micro-batches (GPipe)"
        report = write_report(self.recorder.steady(), labels, self.cfg.parallel.microbatches, 1, out, title, self.accelerator.print)
        return {**mesh_summary(self.layout, self.local_numel), **report}
