"""Weights that transformers converts on loading, read as `from_pretrained` reads them, one tensor at a time.

A mixture of experts' module holds each layer's experts fused (Qwen3-MoE's `mlp.experts.gate_up_proj`, shape
(experts, 2 x inner, hidden)), while `save_pretrained` writes them one expert at a time
(`mlp.experts.0.gate_proj.weight`, `...up_proj.weight`, ...; Mixtral's `block_sparse_moe.experts.0.w1.weight`).
`from_pretrained` fuses them through transformers' own converters (`conversion_mapping.get_model_conversion_mapping`:
WeightConverter, whose operations stack the experts and join gate and up). `ConvertedTensors` runs those same
converter objects, on the file tensors of one fused tensor (one layer's experts) at a time, so a meta-started model
(parallel/model_init.py) is filled rank by rank as for any other tensor: a rank that holds some experts of a layer
(its FSDP2 shard of dim 0) reads only theirs. `save_pretrained` of the fused model writes the per-expert layout
back (transformers' `revert_weight_conversion`), so the export needs nothing of this module.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_train.errors import UserError


@dataclass
class Conversion:
    """One model tensor made of several file tensors: transformers' converter for it, and its sources in the order
    from_pretrained collects them (by source pattern, each pattern's keys in `dot_natural_key` order: expert 0, 1, ...)."""

    converter: Any  # a transformers WeightConverter (the template; each read converts with a copy)
    sources: dict[str, list[tuple[Path, str]]] = field(default_factory=dict)  # source pattern -> [(file, key in the file)]

    def per_expert(self) -> bool:
        """Whether the first operation stacks the sources along dim 0 (MergeModulelist(dim=0)): then source i is row i of
        the result, and a rank reads only the rows it holds."""
        from transformers.core_model_loading import MergeModulelist

        first = self.converter.operations[0]
        return isinstance(first, MergeModulelist) and first.dim == 0

    def convert(self, name: str, tensors: dict[str, list[torch.Tensor]], model: Any) -> torch.Tensor:
        converter = copy.deepcopy(self.converter)
        for pattern, values in tensors.items():
            for value in values:
                converter.add_tensor(name, name, pattern, value)
        out = converter.convert(name, model=model, config=getattr(model, "config", None))
        value = out[name]
        return value[0] if isinstance(value, list) else value


class ConvertedTensors:
    """The model tensors that transformers' converters make from several file tensors, by the model's names.
    `read(name, region)` gives the part `region` of one (None: whole); `shapes` their shapes, checked against the
    model's on construction (by converting meta tensors: nothing is read)."""

    def __init__(self, model: nn.Module, files: list[Path]):
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [c for c in mapping if isinstance(c, WeightRenaming)]
        converters = [c for c in mapping if isinstance(c, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        meta = model.state_dict()
        self.model, self.conversions = model, {}
        found: list[tuple[str, Path, tuple[int, ...], torch.dtype]] = []
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    piece = handle.get_slice(k)
                    found.append((k, f, tuple(piece.get_shape()), piece.get_dtype()))
        self.file_meta = {}
        for key, f, shape, dtype in sorted(found, key=lambda row: dot_natural_key(row[0])):  # from_pretrained's order
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if pattern is None or name not in meta:
                continue  # renamed or unconverted (hf_loading.file_keys), or a tensor the model lacks (ignored, as there)
            conversion = self.conversions.setdefault(name, Conversion(by_pattern[pattern]))
            conversion.sources.setdefault(pattern, []).append((f, key))
            self.file_meta[key] = (shape, dtype)
        self.shapes = {name: self._check(name, tuple(meta[name].shape)) for name in self.conversions}

    def _check(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The converted shape (computed on meta tensors), which must be the model's."""
        conversion = self.conversions[name]
        tensors = {
            pattern: [torch.empty(self.file_meta[k][0], device="meta") for _, k in keys] for pattern, keys in conversion.sources.items()
        }
        first = next(iter(conversion.sources.values()))[0][1]
        try:
            got = tuple(conversion.convert(name, tensors, self.model).shape)
        except Exception as e:  # an operation that cannot run here (a quantized checkpoint's dequantisation, ...)
            raise UserError(
                f"model weights: {first!r} -> {name!r}: transformers' conversion failed ({str(e).splitlines()[0][:160]})"
            ) from None
        if got != shape:
            raise UserError(
                f"model weights: {first!r} and the others of {name!r} convert to shape {list(got)}, but the model's is {list(shape)}; "
                "give the folder save_pretrained wrote for this config.json"
            )
        return got

    def __contains__(self, name: str) -> bool:
        return name in self.conversions

    def __len__(self) -> int:
        return len(self.conversions)

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The converted tensor `name`, or its part `region`. When the conversion stacks one source per row (the experts),
        only the rows of `region` are read and converted: a rank never holds a layer's experts it does not shard."""
        from safetensors import safe_open

        conversion = self.conversions[name]
        rows = region[0] if region is not None and conversion.per_expert() else slice(None)
        wanted = {pattern: keys[rows] for pattern, keys in conversion.sources.items()}
        loaded: dict[str, torch.Tensor] = {}
        for f in dict.fromkeys(f for keys in wanted.values() for f, _ in keys):  # each file opened once
            with safe_open(str(f), framework="pt") as handle:
                loaded.update({key: handle.get_tensor(key) for keys in wanted.values() for g, key in keys if g == f})
        tensors = {pattern: [loaded[key] for _, key in keys] for pattern, keys in wanted.items()}
        value = conversion.convert(name, tensors, self.model)
        if region is None:
            return value
        return value[(slice(None), *region[1:])] if rows != slice(None) else value[region]

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every converted tensor, whole (a model built whole on the CPU: models/hf_loading.py `load_whole`)."""
        return {name: self.read(name) for name in self.conversions}
