"""The model's first weights, rank by rank: built without memory, cut, then each rank fills only what it holds.

A 70B model cannot start by being built whole on every rank. So the trainer builds the model with its
parameters on the meta device (shapes only; buffers such as rotary tables stay real, `init_empty_weights`), the
engine splits it into pipeline stages and shards it over the mesh, and only then does each rank give its own
parameters memory and values (`Initializer.fill`):

- random weights: module by module, a whole CPU copy of one module is initialised by the model's own rule
  (`model.init_weights(name, module)`, or torch's `reset_parameters`) under a seed drawn from the run's seed
  and the module's name, and the rank keeps its slice of it. Keyed by name, not by the order of a random
  stream, the values are the same whatever holds them: one process, a DDP replica, an FSDP2 shard, a
  tensor-parallel slice, a pipeline stage. Peak memory: one module, not one model. A tied weight (models/ties.py) is
  filled by its owner's rule under any of its names, and stays one tensor where a rank holds both names.
- pretrained weights (model.name=hf with hf_pretrained=true): each rank reads its slice of every tensor from
  the safetensors files (`safe_open(...).get_slice`), never the whole file; a tensor that transformers makes from
  several (a layer's experts, fused: models/hf_conversions.py) from the file tensors of the rows it holds; tensors the
  files lack (non-persistent buffers) are initialised as above.

A model opts in by defining `init_weights(self, name: str, module: nn.Module)`, which sets the parameters of
`module` (whole, on the CPU, drawing from torch's global generator, which the caller seeds) and may look at its
name (GPT scales its residual projections by depth). Models without it (your own, until you add it) are built
whole on the CPU as before, with their own initialisation, and the engines cut them from there (`Whole`); a
sharded layout then says so in one line.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from parallel_train.models.meta_copy import meta_copy  # childless: what `initialise` fills on the CPU later
from parallel_train.models.ties import find_ties, keep_identity

InitRule = Callable[[str, nn.Module], None]


def key_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a module's name (stable across Python runs: no hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers a module holds itself (not its children's)."""
    yield from ((n, t) for n, t in module._parameters.items() if t is not None)
    yield from ((n, t) for n, t in module._buffers.items() if t is not None)


def local_region(t: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the whole tensor that `t` holds: its slice for a DTensor (FSDP2, tensor parallel), None for
    a plain tensor (all of it). No communication."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def local_view(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def default_rule(name: str, module: nn.Module) -> None:
    module.reset_parameters()


class Initializer:
    """Fills a meta model's parameters on the rank that holds them (see the module docstring).

    Built from the whole meta model BEFORE it is split or sharded (it keeps a childless template of every module
    that holds tensors); `fill(part, device)` then materialises any part of it: the whole model, a stage view, a
    sharded model. `pretrained`: safetensors files whose tensors (by the model's parameter names) come first.
    """

    def __init__(
        self,
        model: nn.Module,
        seed: int,
        pretrained: list[Path] | None = None,
        aliases: dict[str, str] | None = None,
        fresh: tuple[str, ...] = (),
        grown: dict[str, int] | None = None,
        converted=None,
    ):
        """`converted`: the model's tensors made from several of the files' (models/hf_conversions.py ConvertedTensors)."""
        self.seed = seed
        self.rule: InitRule = getattr(model, "init_weights", None) or default_rule
        self.ties = find_ties(model)  # {alias: owner}: an alias is filled by its owner's rule (models/ties.py)
        self.templates = {name: meta_copy(m) for name, m in model.named_modules() if any(True for _ in own_tensors(m))}
        # Real buffers (built on the CPU: rotary tables, causal masks) keep the values they were built with.
        self.buffers = {
            (name, n): b.detach().clone()
            for name, m in model.named_modules()
            for n, b in m._buffers.items()
            if b is not None and not b.is_meta
        }
        self.pretrained = PretrainedTensors(pretrained, aliases or {}, fresh, grown or {}, converted) if pretrained else None

    def fill(self, module: nn.Module, device: torch.device) -> None:
        """Give `module`'s parameters (this rank's slices) memory on `device` and their first values. A tied weight
        (models/ties.py) takes its owner's values under whichever name this part holds it: a pipeline stage holding only
        the output layer starts with the embedding's draw, as the unsplit model does."""
        with keep_identity():  # a tied weight stays one tensor under its names
            module.to_empty(device=device)
        done: set[int] = set()  # a tied weight (one tensor, two names) is filled once
        with torch.no_grad():
            for name, sub in module.named_modules():
                initialised: dict[str, dict[str, torch.Tensor]] = {}  # a module's rule, run once for all its tensors
                for n, t in own_tensors(sub):
                    if id(t) in done:
                        continue
                    key, region = f"{name}.{n}" if name else n, local_region(t)
                    source = self.ties.get(key, key)
                    owner, _, attr = source.rpartition(".")
                    if (name, n) in self.buffers:
                        value = self.buffers[(name, n)]
                    elif self.pretrained is not None and source in self.pretrained:
                        value, region = self.pretrained.read(source, region), None  # read as this rank's slice
                    else:
                        if owner not in initialised:
                            initialised[owner] = self.initialise(owner)
                        value = initialised[owner][attr]
                        if self.pretrained is not None:  # a grown head (models/hf_head.py): its first rows are the files'
                            value = self.pretrained.grow(source, value)
                    local_view(t).copy_(value if region is None else value[region])
                    done.add(id(t))

    def release(self, module: nn.Module) -> None:
        """Give a filled part's memory back (its parameters on the meta device again): parallel/pipeline/cost.py's probe."""
        module.zero_grad(set_to_none=True)
        with keep_identity():
            module.to_empty(device="meta")

    def initialise(self, name: str) -> dict[str, torch.Tensor]:
        """Module `name`'s own tensors, whole, on the CPU: its rule applied to a copy of its template, under the seed
        keyed by its name (the global generator is forked, so the run's own random stream is untouched)."""
        twin = copy.copy(self.templates[name])
        twin.__dict__ = dict(twin.__dict__)
        twin._parameters, twin._buffers = dict(twin._parameters), dict(twin._buffers)
        twin.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key_seed(self.seed, name))
            self.rule(name, twin)
        return dict(own_tensors(twin))


class PretrainedTensors:
    """Tensors by name from safetensors files; `read` takes only the slice a rank holds (`get_slice`), so no rank
    reads a whole tensor it shards, let alone a whole file."""

    def __init__(
        self, files: list[Path], aliases: dict[str, str], fresh: tuple[str, ...] = (), grown: dict[str, int] | None = None, converted=None
    ):
        from safetensors import safe_open

        self.converted = converted if converted else {}  # name -> read(name, region) from several file tensors
        self.where: dict[str, tuple[Path, str]] = {}  # model name -> (file, the name in the file)
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                self.where.update({k: (f, k) for k in handle.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        # e.g. an untied lm_head whose first values are the embedding's (models/hf.py)
        self.where.update({alias: self.where[name] for alias, name in aliases.items() if name in self.where and alias not in self.where})
        # e.g. LoRA's wrapped fused experts (models/hf_lora.py): experts.base_layer.down_proj is the converted experts.down_proj
        self.renamed = {alias: name for alias, name in aliases.items() if name in self.converted and alias not in self.where}
        for name in fresh:  # not read: the files hold it in another shape (a head of another number of labels)
            self.where.pop(name, None)
        # {name: (its file and name there, the rows it gives)}: a head grown by new classes, read whole (it is small)
        self.grown = {name: (self.where.pop(name), rows) for name, rows in (grown or {}).items() if name in self.where}

    def __contains__(self, key: str) -> bool:
        return key in self.where or key in self.converted or key in self.renamed

    def read(self, key: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.where:
            return self.converted.read(self.renamed.get(key, key), region)
        path, key = self.where[key]
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(key) if region is None else handle.get_slice(key)[region]

    def grow(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """`value` (the whole tensor, freshly initialised) with the rows the files give for it, where it is a grown head."""
        if key not in self.grown:
            return value
        from safetensors import safe_open

        (path, name), rows = self.grown[key]
        with safe_open(str(path), framework="pt") as handle:
            return torch.cat([handle.get_tensor(name)[:rows].to(value.dtype), value[rows:]])


class Whole:
    """For a model built whole on the CPU (no meta start): the engines' `fill` just moves their part."""

    def fill(self, module: nn.Module, device: torch.device) -> None:
        module.to(device)

    def release(self, module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)  # the whole model stays where it is


def can_start_on_meta(model_class: type[nn.Module]) -> bool:
    """Models that say how to initialise one module (init_weights) start on the meta device."""
    return callable(getattr(model_class, "init_weights", None))


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device and their buffers real (accelerate's
    init_empty_weights(include_buffers=False) does the same, but re-wraps a parameter that is already on the meta
    device, which unties a tied weight: here it keeps its identity)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            extra = dict(param.__dict__)  # e.g. transformers' _is_hf_initialized
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            param.__dict__.update(extra)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def start_model(
    model_class: type[nn.Module], cfg, vocab_size: int, seed: int, label_names: list[str] | None = None
) -> tuple[nn.Module, Initializer | Whole]:
    """The model and what fills its parameters: on the meta device with an Initializer when the model can
    (init_weights), else built whole on the CPU under `seed` (its own initialisation) with `Whole`. `label_names`:
    the class names of a task with labels (Data.label_names), given to the model as `label_names=` (its head's size
    and the export's id2label)."""
    extra = {"label_names": label_names} if label_names else {}
    if not can_start_on_meta(model_class):
        torch.manual_seed(seed)
        return model_class(cfg, vocab_size, **extra), Whole()
    with parameters_on_meta():
        model = model_class(cfg, vocab_size, **extra)
    files = model.pretrained_files() if hasattr(model, "pretrained_files") else None
    fresh, grown = tuple(getattr(model, "new_weights", ())), getattr(model, "grown_weights", None)
    converted = getattr(model, "weight_conversions", None)  # fused experts (models/hf_conversions.py)
    return model, Initializer(model, seed, files, getattr(model, "weight_aliases", None), fresh, grown, converted)
