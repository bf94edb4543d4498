"""A transformers model's own tensor-parallel plan as torch ParallelStyles, for `parallelize_module`.

transformers ships a plan with each architecture that supports tensor parallelism (`model.tp_plan`: Llama's
`model.layers.*.self_attn.q_proj: colwise`, ..., `lm_head: colwise_gather_output`), in style names that its own
TP code applies. The template shards with torch's `parallelize_module` (the mesh engine), so the names are
translated here to the torch styles that do the same thing, and the wildcards expanded to the modules this model
(or pipeline stage) holds. Megatron-style: q/k/v and the MLP's gate and up projections by columns (each rank
whole heads), the attention and MLP output projections by rows (one all-reduce each), the embedding by rows of
the vocabulary, lm_head by columns with the logits gathered whole (the loss stays the unsplit model's).
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
    return {name: torch_style(style) for pattern, style in hf_plan.items() for name in names if fnmatchcase(name, pattern)}
