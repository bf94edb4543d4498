"""Activation checkpointing, one switch for every model: `model.activation_checkpointing = none | full | selective`.

    none        every block keeps what autograd saves for backward (fastest, most memory)
    full        each block keeps only its input; backward reruns the block's forward (about 1/3 more compute)
    selective   `model.selective_ac=op` (default): each block keeps the outputs of every other matmul and of
                attention, and recomputes the rest (norms, activations, element-wise ops) in backward;
                `model.selective_ac=N`: every N-th block (0, N, 2N, ...) is checkpointed whole, the others not

These are torchtitan's `full`, `selective op` and `selective N` modes (torchtitan/distributed/activation_checkpoint.py):
the op policy saves the ops that are expensive to recompute (matmuls, attention, a reduce-scatter) and little
else, and of the matmuls every second one, which halves what they keep. The layer mode uses transformers' rule for
`every_n_layers` (layer index % N == 0), so a GPT and a Hugging Face model checkpoint the same layers.

Recomputation gives the same numbers as the first forward (torch saves and restores the RNG state, so dropout
masks repeat), so every mode trains exactly like `none`: tests/test_activation_checkpoint.py holds each mode equal to
`none` on one process and under FSDP2. `true` and `false` (the key's old values) are aliases of `full` and `none`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel_train.core.fields import check, opt

MODES = ("none", "full", "selective")
# `model.activation_checkpointing=true|false` (a bool before the selective mode existed): YAML reads them as booleans,
# which a string key receives as "yes"/"no" (core/fields.py coerce).
ALIASES = {"yes": "full", "no": "none", "true": "full", "false": "none"}


def mode_field() -> Any:
    return opt(
        "none",
        "recompute activations in backward: none; full (each block keeps its input only, about 1/3 more compute); selective "
        "(model.selective_ac: op keeps matmul and attention outputs, N checkpoints every N-th block); true/false = full/none",
        choices=MODES,
        aliases=ALIASES,
    )


def option_field() -> Any:
    return opt("op", "activation_checkpointing=selective: op (per operation, as torchtitan's op mode) or N (every N-th block whole)")


def check_option(option: str) -> None:
    check(
        option == "op" or (option.isdigit() and int(option) >= 1),
        f"model.selective_ac: {option!r} is neither op nor a positive whole number of blocks (e.g. 2: every other block)",
    )


# Ops whose outputs the op policy keeps (torchtitan's list, with the CPU and cuDNN attention kernels and addmm: a
# Linear with a bias is an addmm). Matmuls alternate: the 1st, 3rd, ... kept, the others recomputed.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
ALWAYS_SAVED = {
    op
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "max",
    )
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
}
if hasattr(torch.ops, "_c10d_functional"):  # sequence parallel's reduce-scatter: communication is dearer than memory
    ALWAYS_SAVED.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)


def op_policy_contexts():
    """The (forward, recompute) contexts of one checkpointed call under the op policy: a fresh matmul count each."""
    counts = {False: 0, True: 0}  # forward, recompute: both must pick the same matmuls

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in ALWAYS_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@dataclass(frozen=True)
class Checkpointing:
    """A model's checkpointing: `run(layer, block, *args)` calls one block as its mode says."""

    mode: str = "none"
    option: str = "op"

    def checkpoints(self, layer: int) -> bool:
        """Whether block number `layer` (its index in the whole model, whatever a pipeline stage holds) is checkpointed."""
        if self.mode == "full":
            return True
        return self.mode == "selective" and (self.option == "op" or layer % int(self.option) == 0)

    def kwargs(self) -> dict[str, Any]:
        """torch.utils.checkpoint.checkpoint's keyword arguments for a checkpointed block."""
        op = self.mode == "selective" and self.option == "op"
        return {"use_reentrant": False, **({"context_fn": op_policy_contexts} if op else {})}

    def run(self, layer: int, block: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        if not (self.checkpoints(layer) and torch.is_grad_enabled()):
            return block(*args)
        return checkpoint(block, *args, **self.kwargs())

    def every_n_layers(self) -> int:
        """transformers' `every_n_layers` for this mode (checked: option is op or a whole number)."""
        return int(self.option) if self.mode == "selective" and self.option != "op" else 1
