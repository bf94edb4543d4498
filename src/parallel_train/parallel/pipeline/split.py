"""Cut a model into pipeline stages by module name.

The model contract (GPT and the seed MLP follow it; so can any model written as a sequence of blocks):
- its top-level children, in registration order, are the order in which `forward` runs them;
- a child that is a ModuleDict / ModuleList / Sequential is a row of blocks: each block is a unit
  (`blocks.0`, `blocks.1`, ...); every other child is one unit (`tok_emb`, `ln_f`, `head`, `fc1`);
- `forward` skips parts that are None (a stage keeps only its own parts and sets the others to None);
- units that `forward` uses together can be named in a class attribute
  `pipeline_groups = (("tok_emb", "pos_emb", "drop"),)`: they always land in one stage.
A model whose parts sit deeper (a Hugging Face model: `model.layers.3`, models/hf.py) lists them itself:
`pipeline_units()` returns {dotted name: module} in forward order; a stage's view sets the parts it does not
hold to None (or drops them from their ModuleList) wherever they sit.

A split spec names the units of each stage, stages separated by `|`, units by `,`, with ranges of
blocks written `blocks.0..3`:  `tok_emb,pos_emb,drop,blocks.0..1 | blocks.2..3,ln_f,head`.
Units without parameters (dropout, activations) may be left out: they join the stage of the unit
before them. `auto` balances the parameter count over the stages (contiguous cuts, smallest maximum);
`time` balances the measured forward + backward time of each unit instead (cost.py).
Parameter names never change, so checkpoints stay those of the unsplit model.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

from torch import nn

from parallel_train.errors import UserError
from parallel_train.parallel.parts import CONTAINERS, model_units


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def bundles(model: nn.Module, units: dict[str, nn.Module]) -> list[list[str]]:
    """Units in forward order, bundled: a declared group, and a parameter-less unit with the unit before it."""
    declared = {name: gi for gi, group in enumerate(getattr(model, "pipeline_groups", ())) for name in group}
    bundles: list[list[str]] = []
    for name, module in units.items():
        same_group = bundles and name in declared and declared.get(bundles[-1][-1]) == declared[name]
        if bundles and (same_group or n_params(module) == 0):
            bundles[-1].append(name)
        else:
            bundles.append([name])
    return bundles


def _short_list(names: list[str]) -> str:
    """`blocks.0, blocks.1, blocks.2` -> `blocks.0..2`, for error messages."""
    out: list[str] = []
    for name in names:
        m = re.fullmatch(r"(.+)\.(\d+)", name)
        prev = re.fullmatch(r"(.+?)\.(\d+)(?:\.\.(\d+))?", out[-1]) if out else None  # lazy: `blocks.0..1` is blocks, 0, 1
        if m and prev and prev.group(1) == m.group(1) and int(prev.group(3) or prev.group(2)) + 1 == int(m.group(2)):
            out[-1] = f"{m.group(1)}.{prev.group(2)}..{m.group(2)}"
        else:
            out.append(name)
    return ", ".join(out)


def describe_stages(model: nn.Module, stages: list[list[str]], places: list, seconds: dict[str, float] | None = None) -> str:
    """`stage 0 on cpu: tok_emb, pos_emb, drop, blocks.0..1 (0.41M params) | stage 1 ...` for the start banner;
    with the measured unit times of split=time, each stage's share of the time too."""
    units = model_units(model)
    total = sum(seconds.values()) if seconds else 0.0

    def share(names: list[str]) -> str:
        return f", {100 * sum(seconds[n] for n in names) / total:.0f}% of the measured time" if total else ""

    return " | ".join(
        f"stage {s} on {place}: {_short_list(names)} ({sum(n_params(units[n]) for n in names) / 1e6:.2f}M params{share(names)})"
        for s, (names, place) in enumerate(zip(stages, places, strict=True))
    )


def parse_spec(spec: str, units: dict[str, nn.Module]) -> list[list[str]]:
    """`a,b..c|d` -> [[a, b, ...], [d]], names checked against the model's units."""
    stages: list[list[str]] = []
    for stage_text in spec.split("|"):
        names: list[str] = []
        for item in (s.strip() for s in stage_text.split(",")):
            if not item:
                continue
            m = re.fullmatch(r"(.+)\.(\d+)\.\.(\d+)", item)
            if m:
                lo, hi = int(m.group(2)), int(m.group(3))
                if lo > hi:
                    raise UserError(f"parallel.split: range {item!r} runs backwards; write {m.group(1)}.{hi}..{lo}")
                expanded = [f"{m.group(1)}.{i}" for i in range(lo, hi + 1)]
            elif item not in units and any(u.startswith(item + ".") for u in units):
                expanded = [u for u in units if u.startswith(item + ".")]  # a whole row of blocks
            else:
                expanded = [item]
            for name in expanded:
                if name not in units:
                    raise UserError(f"parallel.split: unknown module {name!r}; this model's parts are {_short_list(list(units))}")
            names.extend(expanded)
        if not names:
            raise UserError(f"parallel.split: stage {len(stages)} of {spec!r} names no module; give each stage at least one")
        stages.append(names)
    return stages


def _complete(model: nn.Module, stages: list[list[str]], units: dict[str, nn.Module]) -> list[list[str]]:
    """Check an explicit split (each unit once, in forward order, groups whole) and add the parameter-less units left out."""
    order = {name: i for i, name in enumerate(units)}
    owner: dict[str, int] = {}
    for s, names in enumerate(stages):
        for name in names:
            if name in owner:
                raise UserError(f"parallel.split: {name!r} is in stage {owner[name]} and stage {s}; give each module to one stage")
            owner[name] = s
    for group in getattr(model, "pipeline_groups", ()):
        where = {owner[n] for n in group if n in owner}
        if len(where) > 1:
            raise UserError(f"parallel.split: {', '.join(group)} are used together by forward; put them in one stage")
    last_seen = -1
    for name in units:  # forward order
        if name in owner:
            if owner[name] < last_seen:
                raise UserError(
                    f"parallel.split: {name!r} (stage {owner[name]}) runs after a module of stage {last_seen}; "
                    "stages must follow the model's forward order"
                )
            last_seen = owner[name]
        elif n_params(units[name]) > 0:
            raise UserError(f"parallel.split: module {name!r} is in no stage; every part with parameters must be placed")
        else:
            owner[name] = max(last_seen, 0)  # dropout, activation: runs where its input is
    return [sorted((n for n in units if owner[n] == s), key=order.get) for s in range(len(stages))]


def balance(weights: list[float], n_stages: int) -> list[int]:
    """Cut points of the contiguous partition of `weights` into n_stages parts with the smallest largest part."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max part for weights[:i] in k parts; cut[k][i]: where the last part starts.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    cuts, i = [], n
    for k in range(n_stages, 0, -1):
        cuts.append(i)
        i = cut[k][i]
    return sorted(cuts)[:-1]


def plan_stages(
    model: nn.Module, n_stages: int, spec: str = "auto", unit_times: Callable[[list[str]], list[float]] | None = None
) -> list[list[str]]:
    """The unit names of each stage: from an explicit spec, balanced by parameter count (`auto`), or balanced by
    measured time (`time`: `unit_times(names)` gives each unit's seconds, see cost.py)."""
    units = model_units(model)
    bundled = bundles(model, units)
    if spec.strip() in ("", "auto", "time"):
        if n_stages > len(bundled):
            raise UserError(
                f"parallel.pipeline_stages={n_stages}: this model has only {len(bundled)} parts to split "
                f"({' | '.join(_short_list(b) for b in bundled)}); use at most {len(bundled)} stages or a deeper model"
            )
        if spec.strip() == "time":
            assert unit_times is not None, "split=time needs the measured unit times"
            seconds = dict(zip(units, unit_times(list(units)), strict=True))
            weights = [sum(seconds[n] for n in b) for b in bundled]
        else:
            weights = [sum(n_params(units[n]) for n in b) for b in bundled]
        cuts = balance(weights, n_stages)
        bounds = [0, *cuts, len(bundled)]
        return [[n for b in bundled[bounds[s] : bounds[s + 1]] for n in b] for s in range(n_stages)]
    stages = parse_spec(spec, units)
    if len(stages) != n_stages:
        raise UserError(
            f"parallel.split: names {len(stages)} stages but parallel.pipeline_stages (x stages_per_rank) is {n_stages}; make them agree"
        )
    return _complete(model, stages, units)


def _view_of(copies: dict[str, nn.Module], path: str) -> nn.Module:
    """The stage view's own shallow copy of the submodule at `path` ("" is the model), made once."""
    if path not in copies:
        parent_path, _, name = path.rpartition(".")
        parent = _view_of(copies, parent_path)
        child = copy.copy(parent._modules[name])  # shallow: shares every submodule, so no weights are copied
        child._modules = dict(child._modules)
        parent._modules[name] = copies[path] = child
    return copies[path]


def stage_module(model: nn.Module, names: list[str]) -> nn.Module:
    """A view of `model` keeping only the units `names` (the others None, or left out of their row of blocks):
    same parameter objects and names."""
    keep = set(names)
    copies = {"": copy.copy(model)}
    copies[""]._modules = dict(model._modules)
    for name in model_units(model):
        if name not in keep:
            parent_path, _, last = name.rpartition(".")
            parent = _view_of(copies, parent_path)
            if isinstance(parent, CONTAINERS):
                del parent._modules[last]
            else:
                parent._modules[last] = None
    return copies[""]
