"""Memory per rank before a launch: parameters, gradients, optimizer state and activations for the mesh a
config describes, and whether that fits a device (scripts/estimate_memory.py prints it).

How, without the devices: a fake process group of the world size (torch's test backend: one process, the
collectives do nothing), the model built on the meta device (shapes, no memory), then cut by
`sharding.parallelize` exactly as a run cuts it, stage by stage for a pipeline. So the parameter count per rank
is not a formula beside the code: it is what a run with this config reports as `local_param_numel`.
Activations: one forward of a micro-batch under FakeTensorMode (shapes only, any size), cut as the engine cuts it
(the whole model on the mesh; stage by stage in a pipeline), counting what is still alive when the loss is computed
(parallel/activation_memory.py), by part of the model: what the run's own activation checkpointing keeps (none, full,
selective op or every N-th block), in the engine's precision (FSDP2's bf16 policy wherever FSDP2 wraps, over one
data-parallel rank too: bf16 activations; autocast in one process and DDP: an fp32 residual stream beside bf16 copies). A forward without checkpointing gives what backward
recomputes, one checkpointed block at a time, and a forward with model.activation_checkpointing=full the
"checkpointed" column: each mode measured once, and one formula turns each into its figure, so a run whose own mode
is full gets the same number in both. Context parallel: rank 0's T/cp of every sequence, through the model's own
all-to-all; expert parallel: each block's experts gathered whole and kept to its backward; one layer's all-to-all
buffers as scratch (parallel/exchange_memory.py).

What the figures assume, stated: fp32 parameters, gradients and optimizer state (AdamW: two moments per parameter,
SGD none), gradients and state only for the parameters that train (LoRA: the adapters); FSDP2 gathers copies in its policy's dtype: two blocks at a time (one computing, one prefetched) plus the
root's own parameters (embeddings, head). In a pipeline an FSDP2 stage stays unsharded from its first forward to the
step's end (reshard_after_forward=False, pipeline/distributed.py; torch's PipelineStage keeps it so from its first
backward anyway): whole parameters, and whole fp32 gradients accumulating. torch's PipelineStage keeps a receive buffer per
micro-batch for each stage's input and its output's gradient, and holds the micro-batches
its schedule has in flight: torch's own order of actions, walked (pipeline/in_flight.py). The peak is the larger
of the start of backward (activations and scratch, no gradients: each step sets them to None) and its end (all
gradients), or both together when gradients accumulate over micro-steps or pipeline micro-batches. Backward needs
scratch beside them: the gradient of the largest tensor a part keeps and of its input (for a language model, the
log-probabilities over the vocabulary: 2 x batch x context x vocab x 4 bytes), counted as "working".
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from parallel_train.config.sections import Config
from parallel_train.data.batch import Batch, repeat
from parallel_train.data.batch import parts as batch_parts
from parallel_train.models import MODELS
from parallel_train.parallel.activation_memory import PartBytes, block_names, kept_per_part
from parallel_train.parallel.exchange_memory import context_part, exchange_bytes, expert_copies, transformers_on_fake, with_experts
from parallel_train.parallel.expert_parallel import expert_numel
from parallel_train.parallel.mesh import MeshLayout, build_device_mesh, resolve_layout
from parallel_train.parallel.parts import counted_units, fsdp_units
from parallel_train.parallel.pipeline.in_flight import in_flight_bytes
from parallel_train.parallel.pipeline.placement import stages_of_rank, stages_per_rank
from parallel_train.parallel.pipeline.split import plan_stages, stage_module
from parallel_train.parallel.precision import DTYPES
from parallel_train.parallel.sharding import fsdp_wraps, local_numel, loss_context, parallelize, tensor_parallel_cuts

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
# Share of a device's memory the estimated live tensors may fill for the verdict "fits": the caching allocator reserves
# more than the live peak (its pools and fragmentation), and the CUDA context and NCCL's buffers sit beside it.
# torchtitan's published reserved memory ran 1.04-1.23x this estimate on the same layouts (docs/BENCHMARKS.md, rows
# T1-T6). At 0.9 an 80 GiB device would have been called a fit for T1 and T5 1F1B, which reserved 82.4 and 82.5 GiB;
# at 0.8 no row that reserved more than 80 GiB is called a fit (T4, 71.9 reserved, is; T5 interleaved and T6, 72.7
# and 75.3, are called too big: cautious, where the other way loses a launch).
USABLE = 0.8


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
    activations: int  # at the peak, as the run keeps them (its model.activation_checkpointing)
    activations_ckpt: int | None  # with model.activation_checkpointing=full instead
    accumulating: bool = False  # gradient accumulation: the gradients outlive a micro-step, beside its activations
    breakdown: dict[str, int] = field(default_factory=dict)  # activation bytes per part of the model, per micro-batch
    stage_buffers: int = 0  # a pipeline stage's receive buffers: one per micro-batch, kept from step to step

    def total(self, checkpointing: bool = False) -> int:
        """The peak (`checkpointing`: with model.activation_checkpointing=full instead of the run's mode): at the start of backward (activations and scratch, no gradients yet: the optimizer step
        sets them to None) or at its end (all gradients), whichever is larger; both at once when accumulating."""
        act = self.activations_ckpt if checkpointing and self.activations_ckpt is not None else self.activations
        backward = self.grads + act + self.working if self.accumulating else max(act + self.working, self.grads)
        return self.params + self.optimizer + self.fsdp_buffers + self.stage_buffers + backward


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
        return [list(counted_units(model))]
    # split=time needs a measurement on a real device: the estimate cuts by parameter count (auto) instead.
    spec = "auto" if p.split.strip() == "time" else p.split
    return plan_stages(model, layout.pp * stages_per_rank(p.schedule, p.stages_per_rank), spec)


def _mesh_or_pipeline(layout: MeshLayout) -> bool:
    """The engines that put FSDP2 over the data-parallel axes: the mesh engine (the layout shards) and the multi-process
    pipeline (parallel/build.py); one process and DDP do not."""
    return layout.pp > 1 or layout.sharded


def _precision(cfg: Config, layout: MeshLayout):
    """(FSDP2's MixedPrecisionPolicy or None, the autocast dtype or None), as the engines pick them
    (parallel/precision.py): where FSDP2 wraps, its policy computes in bf16/fp16 (the mesh engine and the pipeline, over
    one data-parallel rank where there is one) and nothing autocasts; one process and DDP autocast."""
    dtype = DTYPES.get(cfg.train.mixed_precision)
    if dtype is None:
        return None, None
    if _fsdp(cfg, layout):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32), None
    return None, dtype


def _fsdp(cfg: Config, layout: MeshLayout) -> bool:
    """Whether the run's engine wraps the model (or its stages) in FSDP2: the engines' own rule (sharding.fsdp_wraps)."""
    return _mesh_or_pipeline(layout) and fsdp_wraps(layout, cfg.train.mixed_precision in DTYPES)


def build_shapes(model_cfg, vocab_size: int, labels: list[str] | None = None):
    """The model's shapes (built under a meta device by the caller). Memory does not depend on the weights' values: a
    model from elsewhere is built from its config.json alone, no weight file looked for, so a layout is estimated
    before its weights are downloaded."""
    if hasattr(model_cfg, "hf_pretrained"):
        model_cfg = dataclasses.replace(model_cfg, hf_pretrained=False)
    # `labels`: a task's class names (Data.label_names), its head's size, as the trainer hands them (model_init.start_model)
    return MODELS[model_cfg.name](model_cfg, vocab_size, **({"label_names": labels} if labels else {}))


def _held(cfg: Config, layout: MeshLayout, vocab_size: int, mesh, labels=None) -> tuple[list[list[str]], list[tuple]]:
    """The stages (their parts' names) and per pipeline rank: (its stages, parameter elements it holds, those of them
    that train (LoRA: the adapters only), elements FSDP2 gathers whole at once, gradient bytes per part): two blocks
    (one computing, one prefetched) and the root's own parameters (embeddings, final norm, head), which its group
    gathers for the forward and again from the start of backward to its end)."""
    with torch.device("meta"):
        model = build_shapes(cfg.model, vocab_size, labels)
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
        blocks = [local_numel(u) for u in units]
        gathers = [b - expert_numel(u) for b, u in zip(blocks, units, strict=True)]  # EP holds its experts, never gathered
        # FSDP2's unsharded copies, gathered over its shard ranks (dp_shard x cp: context parallel's ranks shard the
        # weights too); over one rank only under bf16/fp16's policy (tensor parallel alone), where torch copies each
        # unit's parameters into a buffer of the policy's dtype
        shards = layout.dp_shard * layout.cp
        copies = shards > 1 or (_fsdp(cfg, layout) and _precision(cfg, layout)[0] is not None)
        gathered = (2 * max(gathers, default=0) + held - sum(blocks)) * shards if copies else 0
        # a part's gradient bytes, for one step without accumulation (a pipeline's gradients all stand: not needed)
        units_by_name = counted_units(model).items() if layout.pp == 1 else ()  # the root (a task's head) has its blocks' too: left out
        part_grads = {name: 4 * local_numel(m, trainable=True) for name, m in units_by_name if m is not model}
        experts = {name: expert_numel(m) for name, m in counted_units(model).items() if m is not model}  # EP: each block's
        out.append((ids, held, sum(local_numel(v, trainable=True) for v in views), gathered, part_grads, experts))
    return plan, out


def _activations(cfg: Config, layout: MeshLayout, vocab_size: int, mesh, sample, model_cfg, labels=None) -> PartBytes:
    """Activation bytes per part of the model for one micro-batch on rank 0's slice of the mesh, with `model_cfg`'s
    activation checkpointing, under the engine's precision (FSDP2's policy or autocast), cut as the engine cuts it:
    the whole model by the mesh engine, or stage by stage by the pipeline engine, each stage with the whole model's
    plan (sequence parallel: a stage receives and keeps 1/tp of the sequence; loss parallel: the last stage's logits
    cut by vocabulary; parallel/sharding.py, models/hf_tensor_parallel.py). What each stage's first part receives is
    measured here too (`PartBytes.inputs`), which sizes the pipeline's receive buffers (`_receive_buffers`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = cfg.parallel
    micro = max(1, cfg.train.batch_size // (p.microbatches if layout.pp > 1 else 1))
    with torch.device("meta"):
        model = build_shapes(model_cfg, vocab_size, labels)
    policy, autocast = _precision(cfg, layout)
    blocks, units = block_names(model), counted_units(model)  # by name, before fully_shard renames the blocks' classes
    cut = MeshLayout(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp, tp=layout.tp)
    plan = _stage_plan(cfg, model, layout)
    views = [stage_module(model, names) for names in plan] if layout.pp > 1 else [model]
    # The engines' decision, on the whole model (parallel/mesh_engine.py, pipeline/distributed.py)
    from parallel_train.tasks.registry import task_of

    logits_cut = tensor_parallel_cuts(model, layout.tp, model_cfg.block_size, task_of(cfg).loss_sum)[1]
    if layout.sharded or _fsdp(cfg, layout):
        for view in views:
            parallelize(view, mesh, cut, mp_policy=policy, shard_data_parallel=_fsdp(cfg, layout), loss_parallel=logits_cut)

    # The batch's other inputs (a packed batch's positions, a dict batch's attention_mask, ...) go to every stage, as
    # the engines hand them (data/batch.py)
    x, y, rest = batch_parts(repeat(sample, micro))
    if layout.cp > 1:
        x, y, rest = context_part(model, mesh, layout.cp, x, y, rest)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for view in views:  # a pipeline's stages one after the other, as the micro-batch goes through them
            x = view(x, **rest)
        return x

    with FakeTensorMode(allow_non_fake_inputs=True), transformers_on_fake(packed="positions" in rest):
        model.to_empty(device="cpu")
        # a pipeline's last stage holds each in-flight micro-batch's output (the logits) until its backward; what a
        # stage makes before its first part runs is that stage's
        stages = tuple((view, names[0]) for view, names in zip(views, plan, strict=True)) if layout.pp > 1 else ()
        return kept_per_part(
            model.train(), forward, x, y, autocast, loss_context(logits_cut), blocks, keep_output=layout.pp > 1, stages=stages, units=units
        )


def _with_checkpointing(model_cfg, mode: str):
    """The model's keys with model.activation_checkpointing=`mode`; None when the model has no such key (it then runs
    without: only "none" is measured)."""
    if not hasattr(model_cfg, "activation_checkpointing"):
        return model_cfg if mode == "none" else None
    return dataclasses.replace(model_cfg, activation_checkpointing=mode)


def _rank_activations(
    cfg: Config, layout: MeshLayout, r: int, ids: list[int], plan, kept: PartBytes, plain: PartBytes, grads: int, part_grads: dict[str, int]
) -> int:
    """Activation bytes at this pipeline rank's peak, as a forward that kept `kept` leaves them: the micro-batches in
    flight as the schedule holds them (pipeline/in_flight.py), plus backward's recomputation of one checkpointed
    block at a time (what the block keeps without checkpointing, `plain`, less what it kept), made when the blocks after
    it (in its stage) have freed what they kept and, where gradients do not accumulate, the parts after it have made
    their gradients (`part_grads`) and the block its own. What the parts past the last block keep (final norm, head,
    loss) is counted as still alive then, though a run frees it first: conservative, by about the loss's
    log-probabilities (8-16 GiB for torchtitan's T1 and T2 rows with a 128k vocabulary, whose published reserved
    memory the estimate stays within 15% of this way). One formula for the run's
    own mode and for the full-checkpointing column, each from its own measured forward. In a pipeline the figure is
    what stands beside the rank's `grads` at its peak (RankMemory.total adds them): before its first backward the
    gradients do not exist, so GPipe's peak may be all micro-batches without them."""
    p = cfg.parallel
    last = len(plan) - 1

    def parts(i: int) -> list[str]:
        return plan[i] + (["loss"] if i == last else [])

    stage_bytes = {i: sum(kept.kept.get(n, 0) for n in parts(i)) for i in ids}
    if layout.pp == 1:
        held = stage_bytes[0]
    else:
        V = stages_per_rank(p.schedule, p.stages_per_rank)
        held = in_flight_bytes(p.schedule, layout.pp, V, p.microbatches, r, stage_bytes, grads) - grads
    recompute = 0
    for i in ids:
        after = 0  # what the blocks past this one kept (freed by then), less the gradients made by then
        for n in reversed(parts(i)):
            after -= part_grads.get(n, 0)
            if n in plain.blocks:
                recompute = max(recompute, plain.kept.get(n, 0) - kept.kept.get(n, 0) - after)
                after += kept.kept.get(n, 0)
    return held + recompute


def _receive_buffers(cfg: Config, layout: MeshLayout, ids: list[int], plan, plain: PartBytes) -> int:
    """Bytes of the buffers torch's PipelineStage makes once for every micro-batch and keeps (its `args_recv_info` and
    `grad_recv_info`): each stage but the first receives its input, each but the last the gradient of its output (the
    next stage's input). Both as measured on the stage views cut as the run cuts them: under sequence parallel
    (B/M, T/tp, H) each."""
    if layout.pp == 1:
        return 0
    received = lambda i: plain.inputs.get(plan[i][0], 0) if 0 < i < len(plan) else 0  # noqa: E731 (stage i's input)
    return cfg.parallel.microbatches * sum(received(i) + received(i + 1) for i in ids)


def estimate(
    cfg: Config, world: int, vocab_size: int, sample: Batch, labels: list[str] | None = None, layout: MeshLayout | None = None
) -> tuple[MeshLayout, list[RankMemory]]:
    """Memory of each pipeline rank (its data-parallel and tensor-parallel peers hold the same, up to the
    rounding of uneven slices: rank 0's slice is the largest). `sample`: one unbatched sample as the data gives it, a
    tuple or a dict of named tensors, at its widest (data/batch.py widest_sample); `labels`: a task's class names.
    `layout`: the mesh as given, not resolved from the keys (a layout the run does not take yet: a published row's)."""
    layout = layout or resolve_layout(cfg, world, env={})
    with fake_world(world):
        mesh = build_device_mesh(layout, "cpu")
        plan, held = _held(cfg, layout, vocab_size, mesh, labels)
        own = getattr(cfg.model, "activation_checkpointing", "none")
        measured: dict[str, PartBytes] = {}  # checkpointing mode -> what its forward keeps: the run's, none and full
        for mode in dict.fromkeys((own, "none", "full")):
            if (mode_cfg := _with_checkpointing(cfg.model, mode)) is not None:
                measured[mode] = _activations(cfg, layout, vocab_size, mesh, sample, mode_cfg, labels)
    run, plain = measured[own], measured["none"]
    policy, _ = _precision(cfg, layout)
    param_bytes = 2 if policy is not None else 4  # FSDP2 gathers (and computes with) bf16/fp16 copies under its policy
    optimizer_states = 2 if cfg.train.optimizer == "adamw" else 0
    exchange = exchange_bytes(cfg.model, layout, plain)
    ranks = []
    for r, (ids, numel, trainable, gathered, part_grads, experts) in enumerate(held):
        mine = [n for i in ids for n in plan[i]] + (["loss"] if len(plan) - 1 in ids else [])
        copies = expert_copies(experts, layout, param_bytes)
        run_r, plain_r = with_experts(run, plain, copies)
        full_r, plain_f = with_experts(measured["full"], plain, copies) if "full" in measured else (None, None)
        grads, buffers = 4 * trainable, gathered * param_bytes  # frozen weights (LoRA's base) have neither gradients nor state
        if layout.pp > 1 and _fsdp(cfg, layout):
            # An FSDP2 stage stays unsharded between micro-batches (reshard_after_forward=False; PipelineStage's
            # set_reshard_after_backward(False), no gradient sync until the last one): its whole parameters in the policy's dtype, and its whole gradients
            # accumulated in fp32 until the reduce-scatter after the last backward.
            shards = layout.dp_shard * layout.cp
            grads, buffers = 4 * trainable * shards, param_bytes * numel * shards
        accumulating = cfg.train.gradient_accumulation_steps > 1 or layout.pp > 1
        beside = {} if accumulating else part_grads  # gradients made before a block's recomputation (else all counted)
        acts = _rank_activations(cfg, layout, r, ids, plan, run_r, plain_r, grads, beside)
        ckpt = _rank_activations(cfg, layout, r, ids, plan, full_r, plain_f, grads, beside) if full_r else None
        ranks.append(
            RankMemory(
                r,
                ids,
                numel,
                4 * numel,
                grads,
                4 * optimizer_states * trainable,
                buffers,
                # backward reruns a checkpointed block whole; an all-to-all's buffers (cp, ep) at a time instead
                max(2 * max((plain.largest.get(n, 0) for n in mine), default=0), exchange),
                acts,
                ckpt,
                accumulating=accumulating,
                breakdown={n: run_r.kept.get(n, 0) for n in mine},
                stage_buffers=_receive_buffers(cfg, layout, ids, plan, plain),
            )
        )
    return layout, ranks


def estimate_config(cfg: Config, world: int) -> tuple[MeshLayout, list[RankMemory], int]:
    """`estimate` for a config, its data read as a run reads it (tasks/registry.py: a task's own columns, or the
    template's tuples): the vocabulary size, a task's class names (its head's size) and the widest sample, a tuple
    or a dict of named tensors. Also the model's whole parameter count."""
    from parallel_train.data.batch import widest_sample
    from parallel_train.tasks.registry import load_task_data, task_of

    task = task_of(cfg)
    data = load_task_data(cfg, task, None)
    labels = data.label_names if task.has_labels else None
    with torch.device("meta"):
        total = sum(q.numel() for q in build_shapes(cfg.model, data.vocab_size, labels).parameters())
    layout, ranks = estimate(cfg, world, data.vocab_size, widest_sample(data.train_set), labels)
    return layout, ranks, total


def as_json(layout: MeshLayout, ranks: list[RankMemory]) -> dict:
    return {"mesh": layout.sizes, "ranks": [{**asdict(r), "total": r.total(), "total_ckpt": r.total(True)} for r in ranks]}
