"""Tied weights: one parameter under several names (`decoder.weight = encoder.weight`, GPT-2's output layer and
token embedding), found in any model and kept one weight on every layout.

A tie is found, not declared: two names of `named_parameters(remove_duplicate=False)` that are the same tensor.
The first name (registration order: the embedding before the output layer) owns it; the others are its aliases.
The map `{alias: owner}` is read from the WHOLE model before anything cuts it (a pipeline stage may hold only the
alias), and then:

- checkpoints store the weight once, under its owner's name, and record the map (optimizer.json `tied`);
  loading gives every name a rank holds the owner's tensor (checkpoint/named_state.py);
- the first weights are the owner's, whichever name a rank holds (parallel/model_init.py), and filling a meta model
  keeps the tie (`keep_identity`: torch's `to_empty` would give each name a tensor of its own);
- exports keep the map in the safetensors header (`TIED_KEY`), and loading them gives the alias its owner's
  values (checkpoint/export.py), so sample.py rebuilds the tied model;
- pipeline stages on different ranks each hold a copy and sum its gradient (parallel/pipeline/tied.py); stages on one
  rank share the tensor itself;
- tensor parallelism would cut the names as two separate weights: refused in one line (parallel/sharding.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import torch
from torch import nn

TIED_KEY = "tied_weights"  # in a safetensors header's metadata and an index's "metadata": json {alias: owner}


def find_ties(module: nn.Module) -> dict[str, str]:
    """{alias: owner} for every parameter registered under more than one name; the owner is its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def tie_groups(ties: dict[str, str]) -> dict[str, list[str]]:
    """{owner: [owner, alias, ...]}, owners in sorted order (every rank walks them alike)."""
    groups: dict[str, list[str]] = {}
    for alias, owner in sorted(ties.items()):
        groups.setdefault(owner, [owner]).append(alias)
    return dict(sorted(groups.items()))


def describe(ties: dict[str, str]) -> str:
    """`head.weight is tok_emb.weight`, for messages."""
    return ", ".join(f"{alias} is {owner}" for alias, owner in sorted(ties.items()))


def with_aliases(state: dict[str, torch.Tensor], ties: dict[str, str]) -> dict[str, torch.Tensor]:
    """`state` (each tied weight once, under its owner's name) with every alias given its owner's tensor."""
    return {**state, **{alias: state[owner] for alias, owner in ties.items() if owner in state and alias not in state}}


def ties_from_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    return json.loads((metadata or {}).get(TIED_KEY, "{}"))


@contextlib.contextmanager
def keep_identity() -> Iterator[None]:
    """Module conversions (`to_empty`, `to`) keep every parameter object, moving its contents into it
    (torch.utils.swap_tensors), so a tied weight stays one object under all its names, in every view of the model
    (a pipeline stage's view shares the parameters). torch's default gives each module a new Parameter, and so two
    parameters to the names of one tied weight. torch already converts DTensor parameters (FSDP2, tensor
    parallel) this way."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
