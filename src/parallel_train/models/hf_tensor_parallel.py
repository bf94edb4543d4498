"""A transformers model's own tensor-parallel plan as torch ParallelStyles, for `parallelize_module`.

transformers ships a plan with each architecture that supports tensor parallelism (`model.tp_plan`: Llama's
`model.layers.*.self_attn.q_proj: colwise`, ..., `lm_head: colwise_gather_output`), in style names that its own
TP code applies. The template shards with torch's `parallelize_module` (the mesh engine), so the names are
translated here to the torch styles that do the same thing, and the wildcards expanded to the modules this model
(or pipeline stage) holds. Megatron-style: q/k/v and the MLP's gate and up projections by columns (each rank
whole heads), the attention and MLP output projections by rows, the embedding by rows of the vocabulary, lm_head
by columns with the logits gathered whole (the mesh engine keeps them cut by vocabulary instead: loss parallel,
parallel/sharding.py).

Sequence parallel (`sequence_parallel`), which transformers' plans do not carry (Llama's names no module in the
`sequence_parallel` style): between the tensor-parallel regions each rank holds 1/tp of the sequence, as torchtitan's
Llama plan has it. The embedding and the row-wise projections reduce-scatter into sequence shards instead of
all-reducing and hand on plain LOCAL tensors of (B, T/tp, H) (use_local_output), the norms run on those shards
(torch's SequenceParallel), and each attention and MLP all-gathers the sequence at its input (PrepareModuleInput).
So a pipeline stage, whatever parts it holds (the embedding alone, layers, layers + norm + head), sends and receives
1/tp of the sequence; hf_layouts.py builds the positions, rotary tables and masks for the whole length (the local
length x `sequence_shards`). One plan for the whole model and for every stage. Added for the decoders whose parts
hf_layouts.py knows by name (Llama, Mistral, Qwen): their residual stream, norms, dropout and a stage's inputs then
cost 1/tp of the memory. tests/test_hf_models.py holds it equal to one process, whole and in pipeline stages.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from parallel_train.errors import UserError


def torch_style(style: str) -> Any | None:
    """The torch ParallelStyle for a transformers style name, or None if it has no plain torch equivalent."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    make = styles.get(style)
    return make() if make else None


def check_heads(config: Any, tp: int, what: str) -> None:
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % tp or kv_heads % tp:
        raise UserError(
            f"parallel.tp={tp} does not divide the {heads} attention heads and {kv_heads} key/value heads of {what}: "
            "each rank holds whole heads; choose a tp that divides both"
        )


def tensor_parallel_plan(
    model: nn.Module, hf_plan: dict[str, str], config: Any, tp: int, what: str, sequence: bool = False
) -> dict[str, Any]:
    """{module name: torch ParallelStyle} for the modules `model` holds, from the transformers plan; `sequence`: with
    sequence parallelism (`sequence_parallel_fits`, decided on the whole model)."""
    if not hf_plan:
        raise UserError(
            f"parallel.tp={tp}: {what} ({config.model_type}) has no tensor-parallel plan in transformers; "
            "shard it with FSDP (parallel.dp_shard) instead"
        )
    unknown = sorted({style for style in hf_plan.values() if torch_style(style) is None})
    if unknown:
        raise UserError(
            f"parallel.tp={tp}: {what} uses tensor-parallel styles with no torch equivalent here ({', '.join(unknown)}); "
            "shard it with FSDP (parallel.dp_shard) instead"
        )
    check_heads(config, tp, what)
    names = [name for name, module in model.named_modules() if name and isinstance(module, (nn.Linear, nn.Embedding))]
    plan = {name: torch_style(style) for pattern, style in hf_plan.items() for name in names if fnmatchcase(name, pattern)}
    return sequence_parallel(model, plan) if sequence else plan


# A decoder's parts by name (hf_layouts.py's rotary layout): what sequence parallelism changes in the plan.
EMBEDDING, FINAL_NORM, OUTPUT = "model.embed_tokens", "model.norm", "lm_head"
LAYER_PARTS = ("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp", "mlp.down_proj")
ROW_CUT = ("self_attn.o_proj", "mlp.down_proj")  # the projections that reduce-scatter into sequence shards


def _layers(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if fnmatchcase(name, "model.layers.*") and name.count(".") == 2]


def sequence_parallel_fits(whole: nn.Module, hf_plan: dict[str, str]) -> bool:
    """Whether the plan gets sequence parallelism: decided on the WHOLE model (every pipeline stage decides alike, so
    what one stage sends is what the next expects): every layer has the parts it cuts, the transformers plan cuts their
    output projections by rows, and the embedding, final norm and head are where the layout says."""
    layers = _layers(whole)
    held = {name for name, _ in whole.named_modules()}
    rows = [f"{layer}.{part}" for layer in layers for part in ROW_CUT]
    return (
        bool(layers)
        and all(f"{layer}.{part}" in held for layer in layers for part in LAYER_PARTS)
        and {EMBEDDING, FINAL_NORM, OUTPUT} <= held
        and all(any(fnmatchcase(n, pattern) and style == "rowwise" for pattern, style in hf_plan.items()) for n in rows)
    )


def sequence_shards(layer: nn.Module) -> int:
    """How many ranks a decoder layer's input sequence is cut over: tp where this plan's SequenceParallel holds its
    input norm (SequenceParallel replicates its weight over the tensor-parallel mesh), else 1. Read from the module as
    it was cut, so it is what the run does, whole model or pipeline stage. The run's meshes are named (parallel/mesh.py:
    the "tp" axis; FSDP2's data-parallel axes have other names); an unnamed 1-D mesh (one built by hand for
    `parallelize_module`) is taken as the tensor-parallel one."""
    weight = getattr(getattr(layer, "input_layernorm", None), "weight", None)
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None:
        return 1
    if mesh.mesh_dim_names:
        return mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    return mesh.size() if mesh.ndim == 1 and weight.placements[0].is_replicate() else 1


def sequence_parallel(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with sequence parallelism between the regions (module docstring) on the parts `model` (the whole model or
    one pipeline stage) holds; the caller decides whether it applies (`sequence_parallel_fits`, on the whole model)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    held = {name for name, _ in model.named_modules()}
    seq, whole = Shard(1), Replicate()
    out = dict(plan)
    # Local outputs (torchtitan's plan): the residual stream is a plain (B, T/tp, H) tensor, which a stage can send.
    if EMBEDDING in held:
        out[EMBEDDING] = RowwiseParallel(input_layouts=whole, output_layouts=seq, use_local_output=True)
    for layer in _layers(model):
        out[f"{layer}.input_layernorm"] = SequenceParallel()
        out[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": whole}, use_local_output=True
        )
        out[f"{layer}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=True)
        out[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        out[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True)
        out[f"{layer}.mlp.down_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=True)
    if FINAL_NORM in held:
        out[FINAL_NORM] = SequenceParallel()
    if OUTPUT in held:
        out[OUTPUT] = ColwiseParallel(input_layouts=seq, output_layouts=whole)
    return out
