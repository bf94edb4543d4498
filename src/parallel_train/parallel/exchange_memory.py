"""Context and expert parallelism in the memory estimate (parallel/memory_estimate.py), and Hub models (a mixture of
experts among them) on its fake tensors.

- Context parallel (parallel/context_parallel.py): the estimate's forward takes rank 0's part of every sequence, as
  the mesh engine cuts the batch, through the model's own all-to-all exchange where it has one (Ulysses).
- Expert parallel's experts, gathered whole in each block's forward over the ranks EP leaves, counted as kept until the
  block's backward, checkpointed blocks included (see `with_experts`: there the term stands in for uneven loads).
- The all-to-all buffers of one layer at a time (context parallel's q, k, v and output; expert parallel's dispatched
  rows): transient, beside backward's other scratch.
- transformers on fake tensors: its experts through its own grouped-matmul fallback (torch 2.13's meta kernel takes
  BF16 only, its CPU kernel fp32 too), and no attention mask for a batch that is not packed, as in a run.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from parallel_train.parallel.activation_memory import PartBytes
from parallel_train.parallel.mesh import MeshLayout


def context_part(model: nn.Module, mesh, cp: int, x: torch.Tensor, y: torch.Tensor, rest: dict):
    """Context parallel: rank 0's part of every sequence, as the mesh engine cuts the batch (inputs, targets and any
    other (B, T, ...) input), and the model's attention through its all-to-all exchange where it has one
    (`use_context_parallel`, parallel/context_parallel.py: run on the fake process group, shapes only). A model
    without one runs its T/cp tokens with plain causal attention: what Ulysses keeps is the same bytes (q, k, v and
    the output whole-sequence for heads/cp, where the plain forward keeps them for T/cp and every head)."""
    from parallel_train.parallel.context_parallel import ContextParallel

    part = ContextParallel(mesh["cp"].get_group(), 0, cp)
    if hasattr(model, "use_context_parallel"):
        model.use_context_parallel(part)
    length = x.size(1)
    cut = lambda t: part.cut(t) if torch.is_tensor(t) and t.dim() > 1 and t.size(1) == length else t  # noqa: E731
    return cut(x), cut(y), {k: cut(v) for k, v in rest.items()}


def exchange_bytes(model_cfg, layout: MeshLayout, plain: PartBytes) -> int:
    """The all-to-all buffers of one layer at a time, a copy sent and a copy received of each exchanged tensor: context
    parallel's q, k, v and output of the largest attention (whole sequence for heads/cp: the bytes of this rank's part
    for every head), expert parallel's dispatched rows (k per token, each a block input's row: k x a block's input),
    measured on the forward. The larger where both; transient, like backward's scratch."""
    cp = 2 * plain.attention if layout.cp > 1 else 0
    if layout.ep == 1:
        return cp
    top_k = getattr(model_cfg, "experts_per_token", 0) if getattr(model_cfg, "n_experts", 0) else hub_top_k(model_cfg)
    return max(cp, 2 * top_k * max((plain.inputs.get(n, 0) for n in plain.blocks), default=0))


def hub_top_k(model_cfg) -> int:
    """Experts each token is routed to in a Hub mixture of experts (its config.json; 0 for a dense or template model)."""
    if getattr(model_cfg, "name", "") != "hf":
        return 0
    from transformers import AutoConfig

    from parallel_train.models.hf_moe import experts_and_top_k

    counts = experts_and_top_k(AutoConfig.from_pretrained(model_cfg.hf_path))
    return counts[1] if counts else 0


def expert_copies(experts: dict[str, int], layout: MeshLayout, dtype_bytes: int) -> dict[str, int]:
    """Bytes of the experts each block gathers whole for its forward under expert parallelism (its `experts`: local
    elements by part): over the "edp" ranks EP leaves, cast to the rows' dtype (parallel/expert_parallel.py
    local_tensor). A copy only where either makes one: fp32 experts on ep = dp_shard are the parameters themselves."""
    edp = layout.dp_shard // layout.ep
    if layout.ep == 1 or (edp == 1 and dtype_bytes == 4):
        return {}
    return {name: n * edp * dtype_bytes for name, n in experts.items() if n}


def with_experts(kept: PartBytes, plain: PartBytes, copies: dict[str, int]) -> tuple[PartBytes, PartBytes]:
    """`kept` and `plain` (the forward without checkpointing, what backward recomputes from) with each block's gathered
    experts (`copies`): held until the block's backward whatever the checkpointing, and gathered once more when
    backward recomputes a checkpointed block (one that keeps less than `plain`). A checkpointed block in fact frees
    them after its forward (tests/test_expert_parallel.py, and a run's resident memory after the forward), but its
    recomputation meets the run's uneven loads, which the estimate's even expert groups leave out: in the cell
    ep2xfsdp2-full of scripts/bench/memory_matrix.py rank 0 computes up to 7,576 rows in a layer where the even share
    is 4,096, and the estimate ran at 0.82 of the measured peak without this term; with every load made even
    (round-robin routing) rank 0's step peaks 60 MiB lower, and the estimate without this term is 0.95 of it. The
    term stands in for the uneven loads until the estimate sizes them."""
    if not copies:
        return kept, plain
    again = {n: b for n, b in copies.items() if kept.kept.get(n, 0) < plain.kept.get(n, 0)}  # recomputed: a second copy
    add = lambda part, extra: {n: b + copies.get(n, 0) + extra.get(n, 0) for n, b in part.kept.items()}  # noqa: E731
    return dataclasses.replace(kept, kept=add(kept, {})), dataclasses.replace(plain, kept=add(plain, again))


@contextlib.contextmanager
def transformers_on_fake(packed: bool):
    """transformers' code on the estimate's fake tensors, made to take the path it takes on a run's real ones:
    - its experts (`integrations/moe.py`): torch 2.13's meta kernel for `aten._grouped_mm` refuses fp32 ("Expected
      inputs of BF16 type") where its CPU kernel, which a run uses, takes it. transformers' own fallback
      (`transformers::grouped_mm_fallback`, a custom op with a fake kernel) saves the same input and weights for
      backward and returns the same shape (the same bytes kept, checked on real tensors);
    - a batch that is not `packed`: given position ids 0..T-1, `find_packed_sequence_indices` cannot read fake values
      to find there is no packing, so a model that builds its own masks (no known layout, hf_layouts.py) made a (B, 1,
      T, T) mask a run never has (hf_layouts.py spares the decoders it knows the same way); it is told what it finds
      in a run, None."""
    patches = []
    with contextlib.suppress(ImportError):  # a transformers without grouped experts: nothing to redirect
        from transformers.integrations import moe

        patches.append((moe, "_can_use_grouped_mm", lambda *args: False))
    if not packed:
        from transformers import masking_utils

        patches.append((masking_utils, "find_packed_sequence_indices", lambda position_ids: None))
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
