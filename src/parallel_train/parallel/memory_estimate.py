"""Memory per rank before a launch: parameters, gradients, optimizer state and activations for the mesh a
config describes, and whether that fits a device (scripts/estimate_memory.py prints it).

How, without the devices: a fake process group of the world size (torch's test backend: one process, the
collectives do nothing), the model built on the meta device (shapes, no memory), then cut by
`sharding.parallelize` exactly as a run cuts it, stage by stage for a pipeline. So the parameter count per rank
is not a formula beside the code: it is what a run with this config reports as `local_param_numel`.
Activations: one forward of a micro-batch under FakeTensorMode (shapes only, any size), counting the bytes of
every tensor autograd saves for backward (parameters excluded), attributed to the model's parts.

What the figures assume, stated: fp32 parameters and gradients (mixed precision is autocast: its bf16 copies
are activations); AdamW keeps two fp32 moments per parameter, SGD none. The peak is the larger of the start of
backward (activations and scratch, no gradients: each step sets them to None) and its end (all gradients),
or both together when gradients accumulate over micro-steps or pipeline micro-batches. FSDP2 holds the whole
parameters of about two blocks at a time (one computing, one prefetched); a pipeline stage holds the
activations of M micro-batches under gpipe and of at most min(M, S) under the other schedules (1F1B's bound;
the interleaved and V schedules' warm-up can hold a few more). Full activation checkpointing keeps each block's
input and recomputes one block at a time in backward; the selective mode (model.activation_checkpointing=selective)
is not modelled yet: it keeps less than none and more than full, and the estimate shows those two. Backward needs scratch beside them: the gradient of the
largest saved tensor and of its input (for a language model, the log-probabilities over the vocabulary:
2 x batch x context x vocab x 4 bytes), counted as "working".
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from parallel_train.config.sections import Config
from parallel_train.losses import loss_fn
from parallel_train.models import build_model
from parallel_train.models.activation_checkpoint import Checkpointing
from parallel_train.parallel.mesh import MeshLayout, build_device_mesh, resolve_layout
from parallel_train.parallel.parts import fsdp_units, model_units
from parallel_train.parallel.pipeline.placement import stages_of_rank, stages_per_rank
from parallel_train.parallel.pipeline.split import plan_stages, stage_module
from parallel_train.parallel.sharding import local_numel, parallelize

GIB = 2**30
# Memory of one device, GiB (the vendors' figures), for --device.
DEVICE_GIB = {
    "h100": 80,
    "h200": 141,
    "b200": 180,
    "a100": 80,
    "a100-40": 40,
    "l40s": 48,
    "l4": 24,
    "a10": 24,
    "rtx4090": 24,
    "mi300x": 192,
}
# Share of a device's memory tensors can use: the CUDA context, NCCL's buffers and the allocator's
# fragmentation take the rest (a rule of thumb, not a measurement).
USABLE = 0.9


@dataclass
class RankMemory:
    pp_rank: int
    stages: list[int]
    param_numel: int  # what this rank holds: summary.json's local_param_numel for rank 0
    params: int  # bytes
    grads: int
    optimizer: int
    fsdp_buffers: int
    working: int  # backward's scratch: the gradients of the largest saved tensor and of its input
    activations: int
    activations_ckpt: int | None  # with model.activation_checkpointing=full (None: the model has no such switch)
    accumulating: bool = False  # gradient accumulation: the gradients outlive a micro-step, beside its activations
    breakdown: dict[str, int] = field(default_factory=dict)  # activation bytes per part of the model, per micro-batch

    def total(self, checkpointing: bool = False) -> int:
        """The peak: at the start of backward (activations and scratch, no gradients yet: the optimizer step
        sets them to None) or at its end (all gradients), whichever is larger; both at once when accumulating."""
        act = self.activations_ckpt if checkpointing and self.activations_ckpt is not None else self.activations
        backward = self.grads + act + self.working if self.accumulating else max(act + self.working, self.grads)
        return self.params + self.optimizer + self.fsdp_buffers + backward


@contextlib.contextmanager
def fake_world(world: int):
    """A process group of `world` ranks in this one process, as rank 0 (torch's fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _stage_plan(cfg: Config, model: nn.Module, layout: MeshLayout) -> list[list[str]]:
    p = cfg.parallel
    if layout.pp == 1:
        return [list(model_units(model))]
    # split=time needs a measurement on a real device: the estimate cuts by parameter count (auto) instead.
    spec = "auto" if p.split.strip() == "time" else p.split
    return plan_stages(model, layout.pp * stages_per_rank(p.schedule, p.stages_per_rank), spec)


def _held(cfg: Config, layout: MeshLayout, vocab_size: int, mesh) -> list[tuple[list[int], int, int]]:
    """Per pipeline rank: (its stages, parameter elements it holds, bytes of the largest FSDP unit whole)."""
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size)
    plan = _stage_plan(cfg, model, layout)
    V = len(plan) // layout.pp
    out = []
    for r in range(layout.pp):
        ids = stages_of_rank(r, layout.pp, V, cfg.parallel.schedule) if layout.pp > 1 else [0]
        views = [stage_module(model, plan[i]) for i in ids] if layout.pp > 1 else [model]
        units = [u for view in views for u in fsdp_units(view)]
        if layout.sharded:
            for view in views:
                parallelize(view, mesh, layout)  # the run's own code: what each rank holds is what it holds here
        held = sum(local_numel(v) for v in views)
        unit_bytes = max((local_numel(u) * layout.dp_shard * 4 for u in units), default=0) if layout.dp_shard > 1 else 0
        out.append((ids, held, unit_bytes))
    return out


def _loss_context(model: nn.Module):
    """torch's loss_parallel where the run has it (its logits cut by vocabulary: sharding.logits_by_vocabulary)."""
    layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(layer, "weight", None)
    if weight is None or not hasattr(weight, "placements") or not any(p.is_shard(0) for p in weight.placements):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def saved_bytes_per_part(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast_dtype
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Bytes autograd saves for backward during one training forward (and the loss), by top-level part of the
    model; the bytes of each part's input; the largest single saved tensor of each part. Run on fake tensors:
    nothing is allocated."""
    units = model_units(model)
    params = {q.untyped_storage()._cdata for q in model.parameters()}
    params |= {q.to_local().untyped_storage()._cdata for q in model.parameters() if hasattr(q, "to_local")}
    current, saved, inputs = ["loss"], {}, {}

    def enter(name):
        def hook(module, args):
            current[0] = name
            inputs[name] = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))

        return hook

    def pack(t):
        # A DTensor saves its local slice: that is what occupies this rank's memory.
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if s._cdata not in params:
            saved.setdefault(s._cdata, (current[0], s))
        return t

    handles = [module.register_forward_pre_hook(enter(name)) for name, module in units.items()]
    amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp, _loss_context(model):
            out = model(x)
            current[0] = "loss"
            loss_fn(out, y)
    finally:
        for h in handles:
            h.remove()
    per_part: dict[str, int] = {}
    largest: dict[str, int] = {}
    for part, storage in saved.values():  # sizes after the forward: FSDP freed the whole weights it gathered
        per_part[part] = per_part.get(part, 0) + storage.nbytes()
        largest[part] = max(largest.get(part, 0), storage.nbytes())
    return per_part, inputs, largest


def _activations(
    cfg: Config, layout: MeshLayout, vocab_size: int, mesh, sample
) -> tuple[dict[str, int], dict[str, int], dict[str, int], bool]:
    """Activation bytes per part of the model for one micro-batch on rank 0's slice of the mesh."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = cfg.parallel
    micro = max(1, cfg.train.batch_size // (p.microbatches if layout.pp > 1 else 1))
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size)
    can_checkpoint = hasattr(model, "activation_checkpointing")
    if can_checkpoint:
        model.activation_checkpointing = Checkpointing()  # measured without; full checkpointing is derived from the parts
    if layout.sharded:
        # The mesh engine's cut, loss parallel included (a pipeline keeps its logits whole: parallel/sharding.py)
        cut = MeshLayout(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp)
        parallelize(model, mesh, cut, loss_parallel=layout.tp > 1 and layout.pp == 1)
    precision = cfg.train.mixed_precision
    dtype = torch.bfloat16 if precision in ("bf16", "fp16") else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        x, y = (torch.stack([t] * micro) for t in sample)
        per_part, inputs, largest = saved_bytes_per_part(model.train(), x, y, dtype)
    return per_part, inputs, largest, can_checkpoint


def estimate(cfg: Config, world: int, vocab_size: int, sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[MeshLayout, list[RankMemory]]:
    """Memory of each pipeline rank (its data-parallel and tensor-parallel peers hold the same, up to the
    rounding of uneven slices: rank 0's slice is the largest)."""
    layout = resolve_layout(cfg, world, env={})
    with fake_world(world):
        mesh = build_device_mesh(layout, "cpu")
        held = _held(cfg, layout, vocab_size, mesh)
        per_part, inputs, largest, can_checkpoint = _activations(cfg, layout, vocab_size, mesh, sample)
    with torch.device("meta"):
        plan = _stage_plan(cfg, build_model(cfg.model, vocab_size), layout)
    p = cfg.parallel
    in_flight = 1 if layout.pp == 1 else p.microbatches if p.schedule == "gpipe" else min(p.microbatches, layout.pp)
    optimizer_states = 2 if cfg.train.optimizer == "adamw" else 0
    ranks = []
    for r, (ids, numel, unit_bytes) in enumerate(held):
        parts = [n for i in ids for n in plan[i]] + (["loss"] if len(plan) - 1 in ids else [])
        mine = {n: per_part.get(n, 0) for n in parts}
        acts = in_flight * sum(mine.values())
        ckpt = None
        if can_checkpoint:
            blocks = [n for n in mine if "." in n]  # rows of blocks (blocks.0, ...): what checkpointing recomputes
            kept = sum(v for n, v in mine.items() if n not in blocks) + sum(inputs.get(n, 0) for n in blocks)
            ckpt = in_flight * kept + max((mine[n] for n in blocks), default=0)
        working = 2 * max((largest.get(n, 0) for n in parts), default=0)
        ranks.append(
            RankMemory(
                r,
                ids,
                numel,
                4 * numel,
                4 * numel,
                4 * optimizer_states * numel,
                2 * unit_bytes,
                working,
                acts,
                ckpt,
                accumulating=cfg.train.gradient_accumulation_steps > 1 or in_flight > 1 or layout.pp > 1,
                breakdown=mine,
            )
        )
    return layout, ranks


def as_json(layout: MeshLayout, ranks: list[RankMemory]) -> dict:
    return {"mesh": layout.sizes, "ranks": [{**asdict(r), "total": r.total(), "total_ckpt": r.total(True)} for r in ranks]}
