"""Cut a model over the device mesh: tensor parallel by the model's own plan, then FSDP2, with torch's own APIs.

`parallelize` is the one place that decides what each rank holds; the mesh engine, the multi-process pipeline
(on each stage) and scripts/estimate_memory.py (on a model on the meta device) all call it, so the memory
estimate counts exactly the parameters a real run holds.

1. Tensor parallel (`parallel.tp`): `parallelize_module(model, mesh["tp"], model.tensor_parallel_plan(tp))`.
   The plan belongs to the model (models/gpt.py keeps it next to the layers it cuts, as torchtitan does;
   models/hf.py translates transformers' own plan for the architecture, hf_tensor_parallel.py); parts
   a pipeline stage does not hold are skipped.
2. `train.compile`: each block (the FSDP units below) compiled on its own, as torchtitan does.
3. FSDP2 (`parallel.dp_shard`, with dp_replicate: HSDP): `fully_shard` on every unit the model names
   (`fsdp_units`: GPT's blocks, a Hugging Face model's decoder layers; one FSDP unit each: only one block's whole
   weights exist at a time), then on the model itself for the rest (embeddings, final norm, head). Over a TP model this shards the TP slices further (2-D DTensors).
   Under bf16/fp16 (`mp_policy`) FSDP2 wraps even where there is one data-parallel rank (tensor parallel alone, pipeline
   stages without replicas), over the dp_shard axis of size 1: its MixedPrecisionPolicy is what computes the layers in
   bf16 from fp32 master weights (saved activations and the residual stream in bf16, half of autocast's fp32 stream
   beside bf16 copies), and on one rank it gathers nothing (torch copies the shard into the bf16 buffer; the
   reduce-scatter of one rank leaves the gradient as it is). One mechanism for every multi-process engine rather than a
   second (bf16 module copies beside fp32 masters) beside it. 1 process and DDP keep autocast (`fsdp_wraps`;
   docs/parallelism.md, "Precision and compile").
Parameter names never change, so checkpoints stay those of the unsplit model.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from parallel_train.errors import UserError
from parallel_train.losses import plain_cross_entropy
from parallel_train.parallel.expert_parallel import shard_experts
from parallel_train.parallel.hf_expert_parallel import shard_hub_experts
from parallel_train.parallel.mesh import MeshLayout, data_parallel_mesh
from parallel_train.parallel.parts import fsdp_units


def tensor_parallel_plan(model: nn.Module, tp: int) -> dict:
    """The model's plan, restricted to the parts this module holds (a pipeline stage holds a few)."""
    make_plan = getattr(model, "tensor_parallel_plan", None)
    if make_plan is None:
        raise UserError(
            f"parallel.tp={tp}: {type(model).__name__} has no tensor-parallel plan; give its class a method "
            "`tensor_parallel_plan(self, tp)` returning {module name: ColwiseParallel() / RowwiseParallel() / ...} "
            "(see GPT.tensor_parallel_plan in models/gpt.py and docs/parallelism.md), or use parallel.dp_shard instead"
        )
    plan = make_plan(tp)
    return {name: style for name, style in plan.items() if _holds(model, name)}


def output_layer(model: nn.Module, plan: dict) -> str | None:
    """The name of the layer that makes the logits (`get_output_embeddings()`, as transformers names it) when the plan
    cuts it by columns, i.e. by vocabulary: then its logits can stay cut (loss parallel). None otherwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    get = getattr(model, "get_output_embeddings", None)
    layer = get() if get is not None else None
    name = next((n for n, m in model.named_modules() if layer is not None and m is layer), None)
    return name if isinstance(plan.get(name), ColwiseParallel) else None


def logits_by_vocabulary(model: nn.Module, plan: dict) -> dict:
    """Loss parallel: the output layer's logits stay cut by vocabulary, a DTensor sharded on its last dim, instead of
    gathered whole on every rank (128k vocabulary x 8k tokens x batch, in fp32 for the loss). Cross-entropy then runs on
    the shards under torch's `loss_parallel` (parallel/mesh_engine.py): each rank's log-softmax over its slice, two
    small all-reduces for the max and the sum."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    name = output_layer(model, plan)
    if name is None:
        return plan
    return {**plan, name: ColwiseParallel(input_layouts=plan[name].input_layouts[0], output_layouts=Shard(-1), use_local_output=False)}


def tensor_parallel_cuts(model: nn.Module, tp: int, length: int | None = None, loss_sum=None) -> tuple[bool, bool]:
    """(sequence parallel, loss parallel) for `model` (the WHOLE model: a pipeline's stages are cut alike) under
    `parallel.tp`: whether its plan runs norms on sequence shards, and whether its logits stay cut by vocabulary. The
    engines and the memory estimate ask this one function, on every rank before any collective, so all decide alike:
    - `length` (model.block_size, the longest sequence a batch holds): sequence parallel cuts every sequence into tp
      equal shards, so a length tp does not divide is refused in one line (`check_length`);
    - `loss_sum` (the task's loss): loss parallel computes plain cross-entropy only; any other objective
      (losses.plain_cross_entropy says) keeps the plan's gathered logits, on which the user's function runs
      (`gathered_logits_notice` says what that costs)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if tp == 1:
        return False, False
    plan = tensor_parallel_plan(model, tp)
    sequence = any(isinstance(style, SequenceParallel) for style in plan.values())
    if sequence and length is not None:
        check_length(length, tp)
    return sequence, output_layer(model, plan) is not None and plain_cross_entropy(loss_sum)


def check_length(length: int, tp: int) -> None:
    """Sequence parallel holds 1/tp of every sequence on each rank: a model.block_size that tp does not divide would
    cut it unevenly, which the collectives between the shards cannot exchange (gloo aborts, NCCL hangs)."""
    if length % tp:
        lower, upper = length - length % tp, length + tp - length % tp
        choices = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(
            f"model.block_size={length}: sequence parallel cuts every sequence into parallel.tp={tp} equal shards, and {tp} "
            f"does not divide {length}; choose a model.block_size that is a multiple of {tp} ({choices})"
        )


def gathered_logits_notice(model: nn.Module, tp: int, loss_parallel: bool, batch: int, length: int) -> str | None:
    """One line where tensor parallelism cuts the output layer by vocabulary but the loss is not plain cross-entropy,
    so the logits of each micro-batch are gathered whole on every tensor-parallel rank for it (None elsewhere)."""
    if tp == 1 or loss_parallel or output_layer(model, tensor_parallel_plan(model, tp)) is None:
        return None
    vocab = model.get_output_embeddings().weight.shape[0]
    whole = batch * length * vocab * 4
    return (
        f"notice: token_losses (src/parallel_train/losses.py) is not plain cross-entropy, so loss parallel cannot serve it: "
        f"under parallel.tp={tp} the logits are gathered whole for it on every rank, {batch} x {length} x {vocab} x 4 bytes = "
        f"{whole / 2**20:,.1f} MiB per micro-batch in fp32 (loss parallel would hold {whole / tp / 2**20:,.1f} MiB)"
    )


def cuts_line(sequence: bool, loss: bool) -> str:
    """The engine banner's words for them ("; sequence parallel and loss parallel"), or ""."""
    words = [w for w, on in (("sequence parallel", sequence), ("loss parallel", loss)) if on]
    return "; " + " and ".join(words) if words else ""


def loss_context(on: bool):
    """torch's `loss_parallel()` where the logits stay cut by vocabulary (`logits_by_vocabulary`), else nothing: forward,
    loss and backward run inside it (the mesh engine's step, the memory estimate's forward)."""
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def refuse_cut_ties(model: nn.Module, ties: dict[str, str], tp: int) -> None:
    """One line where tensor parallelism would cut a tied weight (models/ties.py): `parallelize_module` gives each module
    in the plan its own sharded parameter, so the names would become separate weights. Checked on the whole model
    (every rank decides alike), after the model's own plan (an HF model's refusal says how to untie it)."""
    if tp == 1 or not ties:
        return
    plan = tensor_parallel_plan(model, tp)
    for alias, owner in sorted(ties.items()):
        cut = [name.rpartition(".")[0] for name in (owner, alias) if any(name.startswith(part + ".") for part in plan)]
        if cut:
            raise UserError(
                f"parallel.tp={tp}: {alias} is {owner} (tied weights), and tensor parallelism would cut {' and '.join(cut)} "
                "as separate weights; untie them (GPT: model.tie_embeddings=false) or shard with parallel.dp_shard instead"
            )


def _holds(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:  # a part set to None by the pipeline splitter, or a block another stage holds
        return False


def fsdp_wraps(layout: MeshLayout, low_precision: bool) -> bool:
    """Whether an engine that puts FSDP2 over the data-parallel axes (the mesh engine, the multi-process pipeline) does
    so for this layout: with several data-parallel (or context-parallel) ranks, or with one under bf16/fp16's policy (bf16 through the
    layers: see the module docstring). The engines and the memory estimate ask this one function."""
    return layout.dp > 1 or layout.cp > 1 or low_precision


def parallelize(
    model: nn.Module,
    mesh,
    layout: MeshLayout,
    mp_policy=None,
    compile: bool = False,
    shard_data_parallel: bool | None = None,
    reshard_after_forward: bool = True,
    loss_parallel: bool = False,
) -> str:
    """Tensor parallel, then torch.compile per block, then FSDP2, in place (torchtitan's order: each block is
    compiled with its tensor-parallel collectives, and FSDP2's hooks stay outside the compiled code). `mesh` is
    mesh.build_device_mesh's (all four axes). `mp_policy`: FSDP2's MixedPrecisionPolicy (parallel/precision.py).
    `shard_data_parallel`: put FSDP2 over the data-parallel axes (default: when the layout shards; a pipeline
    also asks for it with plain replicas, which FSDP2 then keeps whole and all-reduces like DDP): where there are
    several data-parallel ranks, or one under `mp_policy` (`fsdp_wraps`).
    `loss_parallel`: the logits stay cut by vocabulary (`logits_by_vocabulary`).
    Returns what was compiled, for the start banner ("" when nothing)."""
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = tensor_parallel_plan(model, layout.tp)
        parallelize_module(model, mesh["tp"], logits_by_vocabulary(model, plan) if loss_parallel else plan)
    compiled = ""
    if compile:
        # In place (nn.Module.compile): parameter names stay canonical for checkpoints.
        units = fsdp_units(model) or [model]
        for unit in units:
            unit.compile()
        compiled = "the model" if units[0] is model else f"{len(units)} blocks, each on its own (torch.compile)"
    if fsdp_wraps(layout, mp_policy is not None) and (layout.sharded if shard_data_parallel is None else shard_data_parallel):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options = {"mesh": data_parallel_mesh(mesh, layout), "reshard_after_forward": reshard_after_forward}
        dp = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        experts = shard_experts(model, dp, layout.ep) | shard_hub_experts(model, mesh["dp_shard"], layout.ep)
        options["ignored_params"] = experts or None  # EP holds them instead
        options["mp_policy"] = mp_policy or MixedPrecisionPolicy()
        for block in fsdp_units(model):
            fully_shard(block, **options)
        fully_shard(model, **options)
    return compiled


def local_numel(module: nn.Module, trainable: bool = False) -> int:
    """Parameter elements this rank holds (its slices of sharded parameters, the whole of the others); `trainable`:
    only those that require a gradient (LoRA freezes the rest: no gradient, no optimizer state)."""
    return sum(
        q.to_local().numel() if hasattr(q, "to_local") else q.numel() for q in module.parameters() if q.requires_grad or not trainable
    )


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None, not_counted: set[int] | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model, for parameters that may be DTensors on different
    meshes (torch's own needs one mesh), next to plain ones (a Hugging Face plan leaves the norms whole), and split
    over pipeline stages: squared norms of each mesh's parameters (a DTensor norm, all-reduced by DTensor), of plain
    ones, then summed over the stages; each group is then scaled by the one total. `not_counted`: ids of parameters
    clipped but left out of the norm (the other copies of a tied weight, parallel/pipeline/tied.py)."""
    with_grads = [q for q in params if q.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}  # mesh (None: plain tensors) -> its parameters
    for q in with_grads:
        groups.setdefault(getattr(q.grad, "device_mesh", None), []).append(q)
    device = with_grads[0].device if with_grads else torch.device("cpu")
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for group in groups.values():
        counted = [q.grad for q in group if not not_counted or id(q) not in not_counted]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, 2.0)
        sq += (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().pow(2)
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    for group in groups.values():  # one mesh at a time: torch's foreach ops refuse DTensors mixed with plain tensors
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
