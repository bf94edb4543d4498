"""A rank's training state by name: the keys a checkpoint stores, and loading them back into any topology.

Keys: `model/<name>` for weights and buffers, `optimizer/<name>/<state>` (e.g. `optimizer/blocks.0.attn.qkv.weight/
exp_avg`) for the optimizer's tensors; everything else about the optimizer (its param groups, each with its
parameters' names, and any non-tensor state) is a small JSON dict. Positions in an optimizer depend on how the
model was cut (a pipeline stage holds a few parameters); names do not, so a checkpoint from any topology loads
into any other. Sharded state (FSDP2 and tensor-parallel DTensors) stays sharded: each rank names its own shards,
and the storage (checkpoint/storage.py) writes and reads the pieces.

Why not torch's `get_state_dict`/`set_state_dict` (torch.distributed.checkpoint.state_dict), which also name the
state: in torch 2.13 `set_state_dict` fails on an empty param group (IndexError in `_unflatten_optim_state_dict`; a
pipeline stage without biases has one), and both start a fresh optimizer by running a step with zero gradients.
Naming the state here takes a few lines and keeps optimizer.json what earlier versions of this template wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallel_train.errors import UserError


@dataclass
class RankState:
    """This rank's part of the training state, under canonical parameter names: what checkpoints write and read.

    Whole tensors (one process, DDP), DTensor shards (FSDP2, tensor parallel) or a pipeline rank's own stages; no
    copy and no communication. checkpoint/checkpointer.py writes each rank's part once (replicated tensors by one rank only) and
    loads any checkpoint into any RankState by name, so checkpoints move between topologies.
    """

    model: dict[str, torch.Tensor]  # weights and buffers by canonical name (module.state_dict())
    module: nn.Module  # holds this rank's parameters under canonical names (named_parameters, load_state_dict)
    # the torch optimizer over exactly those parameters; None where its state has no per-parameter form (DeepSpeed ZeRO)
    optimizer: torch.optim.Optimizer | None
    # {alias: owner} of the WHOLE model's tied weights (models/ties.py), found before it was cut: a tied weight is stored
    # once, under its owner's name, and loaded into every name a rank holds (a pipeline stage may hold only the alias)
    ties: dict[str, str] = field(default_factory=dict)


MODEL, OPTIMIZER = "model/", "optimizer/"
ZERO_MISSING = "DeepSpeed ZeRO optimizer state (partitioned) is not saved"


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's AcceleratedOptimizer (itself if it is one)."""
    return getattr(optimizer, "optimizer", optimizer)


def _param_names(rank: RankState) -> dict[int, str]:
    """Each parameter's name in the checkpoint: a tied weight's owner's name, whichever name this rank holds it by."""
    return {id(p): rank.ties.get(n, n) for n, p in rank.module.named_parameters()}


def _model_keys(rank: RankState) -> dict[str, str]:
    """{checkpoint key: the name in rank.model}: a tied weight once, under its owner's name (models/ties.py)."""
    keys: dict[str, str] = {}
    for name in rank.model:
        keys.setdefault(MODEL + rank.ties.get(name, name), name)
    return keys


def rank_tensors(rank: RankState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors under checkpoint keys (the live tensors: no copy), and the optimizer's JSON part (with
    the model's tied names, `tied`: {alias: owner})."""
    tensors = {key: rank.model[name].detach() for key, name in _model_keys(rank).items()}
    optimizer = torch_optimizer(rank.optimizer) if rank.optimizer is not None else None
    sd = optimizer.state_dict() if optimizer is not None else {}
    if "state" not in sd:  # DeepSpeed ZeRO keeps flat partitions, not one state per parameter: nothing to name
        return tensors, {"param_groups": [], "scalars": {}, "missing": ZERO_MISSING, "tied": rank.ties}
    names = _param_names(rank)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    scalars: dict[str, Any] = {}
    for idx, param_state in sd["state"].items():
        name = names[id(params[idx])]
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"{OPTIMIZER}{name}/{key}"] = value.detach()
            else:
                scalars[f"{name}/{key}"] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars, "tied": rank.ties}


def merge_meta(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's optimizer JSON in one: a pipeline rank knows only its own parameters' names and scalars.
    Replicas (DDP, FSDP) agree, so their names are listed once; hyperparameters are the same on every rank."""
    first = parts[0]
    if "missing" in first:
        return first
    groups = []
    for gi, group in enumerate(first["param_groups"]):
        names = list(dict.fromkeys(n for part in parts for n in part["param_groups"][gi]["params"]))
        groups.append({**group, "params": names})
    scalars = {k: v for part in parts for k, v in part["scalars"].items()}
    return {"param_groups": groups, "scalars": scalars, "tied": first.get("tied", {})}  # the whole model's, on every rank


def templates(rank: RankState, saved: dict[str, tuple[torch.Size, torch.dtype]], model_names: set[str]) -> dict[str, torch.Tensor]:
    """Empty tensors laid out like this rank's state (DTensor shards where it is sharded) for every checkpoint key
    it loads; `saved` maps the checkpoint's keys to their whole shape and dtype, `model_names` are the weights of
    the whole model (every rank's). A one-line UserError when the checkpoint lacks a weight of this model, holds it
    in another shape, or holds weights the model does not have (another n_layer, say)."""
    extra = sorted(k[len(MODEL) :] for k in saved if k.startswith(MODEL) and k[len(MODEL) :] not in model_names)
    if extra:
        raise UserError(f"the checkpoint holds {extra[0]!r} ({len(extra)} weights this model lacks); was it written for another model?")
    out: dict[str, torch.Tensor] = {}
    keys = _model_keys(rank)
    for key, name in keys.items():
        value = rank.model[name]
        if key not in saved:
            missing = [n for n in keys if n not in saved]
            raise UserError(
                f"the checkpoint has no {name!r} ({len(missing)} of this model's weights missing); was it written for another model?"
            )
        if tuple(saved[key][0]) != tuple(value.shape):
            raise UserError(f"{name!r} has shape {list(saved[key][0])} in the checkpoint, {list(value.shape)} in this model")
        out[key] = torch.empty_like(value)  # a DTensor stays a DTensor with the same placements
    if rank.optimizer is None:
        return out
    for name, param in rank.module.named_parameters():
        prefix = f"{OPTIMIZER}{rank.ties.get(name, name)}/"
        for key in (k for k in saved if k.startswith(prefix)):
            shape, dtype = saved[key]
            # Moments have the parameter's shape and are sharded like it; anything else (Adam's step) is whole.
            like_param = tuple(shape) == tuple(param.shape)
            out[key] = torch.empty_like(param, dtype=dtype) if like_param else torch.empty(tuple(shape), dtype=dtype)
    return out


def load_into(rank: RankState, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Load checkpoint tensors (laid out by `templates`) and the optimizer's JSON into this rank's model and optimizer.
    Every name of a tied weight this rank holds gets the owner's tensor."""
    rank.module.load_state_dict({name: tensors[MODEL + rank.ties.get(name, name)] for name in rank.model})
    if rank.optimizer is not None:
        load_optimizer_by_name(rank, {k[len(OPTIMIZER) :]: v for k, v in tensors.items() if k.startswith(OPTIMIZER)}, meta)


def load_optimizer_by_name(rank: RankState, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """The optimizer's state from `name/state` tensors and the JSON part, for whichever parameters it holds."""
    optimizer = torch_optimizer(rank.optimizer)
    sd = optimizer.state_dict()
    if "missing" in meta or "state" not in sd:  # saved under DeepSpeed ZeRO, or loading into it: the optimizer starts fresh
        return
    names = _param_names(rank)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    seen: set[str] = set()
    for idx, p in enumerate(params):
        prefix = names[id(p)] + "/"
        # Two copies of one tied weight on this rank (stages sharded apart) each get their own state, never one shared.
        entry = {k[len(prefix) :]: (v.clone() if prefix in seen else v) for k, v in tensors.items() if k.startswith(prefix)}
        seen.add(prefix)
        entry.update({k[len(prefix) :]: v for k, v in meta["scalars"].items() if k.startswith(prefix)})
        if entry:
            state[idx] = entry
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(sd["param_groups"]):
        raise UserError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(sd['param_groups'])}; "
            "was it written with another train.optimizer?"
        )
    groups = []
    for saved, current in zip(saved_groups, sd["param_groups"], strict=True):
        hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"}  # JSON lists were tuples
        groups.append({**current, **hyper, "params": current["params"]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
