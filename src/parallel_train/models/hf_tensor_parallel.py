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
`sequence_parallel` style): between the tensor-parallel regions each rank holds 1/tp of the sequence. The
embedding and the row-wise projections reduce-scatter into sequence shards instead of all-reducing, the norms
run on the shards (torch's SequenceParallel), and each attention and MLP all-gathers the sequence at its input
(PrepareModuleInput), as torchtitan's Llama plan does. The hidden states between the regions stay DTensors, so
their shape is the whole sequence's and hf_layouts.py builds the positions, rotary tables and masks as without it.
Added for the decoders whose parts hf_layouts.py knows by name (Llama, Mistral, Qwen): their residual stream,
norms and dropout then cost 1/tp of the memory. tests/test_hf_models.py holds it equal to one process.
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


def tensor_parallel_plan(model: nn.Module, hf_plan: dict[str, str], config: Any, tp: int, what: str) -> dict[str, Any]:
    """{module name: torch ParallelStyle} for the modules `model` holds, from the transformers plan."""
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
    return sequence_parallel(model, plan)


# A decoder's parts by name (hf_layouts.py's rotary layout): what sequence parallelism changes in the plan.
EMBEDDING, FINAL_NORM, OUTPUT = "model.embed_tokens", "model.norm", "lm_head"
LAYER_PARTS = ("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp", "mlp.down_proj")


def sequence_parallel(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with sequence parallelism between the regions (module docstring), where the model's layers have the parts
    it names and the plan cuts them as Megatron does; else `plan` as it is (tensor parallel without it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    layers = [name for name, _ in model.named_modules() if fnmatchcase(name, "model.layers.*") and name.count(".") == 2]
    held = {name for name, _ in model.named_modules()}
    needed = [f"{layer}.{part}" for layer in layers for part in LAYER_PARTS] + [EMBEDDING, FINAL_NORM, OUTPUT]
    # The whole model only: a pipeline stage sends plain tensors to the next, so stages run tensor parallel without it.
    if not layers or not all(n in held for n in needed) or any(n.endswith(("o_proj", "down_proj")) and n not in plan for n in needed):
        return plan
    seq, whole = Shard(1), Replicate()
    out = dict(plan)
    out[EMBEDDING] = RowwiseParallel(input_layouts=whole, output_layouts=seq, use_local_output=False)
    for layer in layers:
        out[f"{layer}.input_layernorm"] = SequenceParallel()
        out[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": whole}, use_local_output=True
        )
        out[f"{layer}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=False)
        out[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        out[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True)
        out[f"{layer}.mlp.down_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=False)
    out[FINAL_NORM] = SequenceParallel()
    out[OUTPUT] = ColwiseParallel(input_layouts=seq, output_layouts=whole)
    return out
