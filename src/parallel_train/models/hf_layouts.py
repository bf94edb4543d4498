"""How a Hugging Face decoder runs part by part, so that any contiguous run of its parts can be a pipeline stage.

A transformers causal LM runs embeddings -> decoder layers -> final norm -> lm_head, but its own `forward` needs
every part. This module runs the same parts one by one and skips those a stage does not hold (set to None by
the splitter), computing in every stage what its layers need besides the hidden states:
- position ids: 0..T-1, or a packed batch's own positions (each sample's from 0; data/batch.py), from which
  transformers' masks keep the packed samples apart (`find_packed_sequence_indices`);
- the rotary cos/sin from the model's own rotary module (Llama-style models);
- the causal mask through the model's attention implementation (`create_causal_mask`: None under sdpa, which
  then runs its is_causal kernel; a sliding-window mask for layers that slide), with a dict batch's padding
  (`attention_mask`, (B, T) 1/0) folded in as the model's own forward folds it;
- under sequence parallel (hf_tensor_parallel.py) a layer's hidden states are 1/tp of the sequence, on a pipeline
  stage as on the whole model: the positions, rotary tables and masks are still built for the whole length.

A layout names the parts of one family; `LAYOUTS` maps a config's model_type to its layout. Each family listed
is tested equal to the model's own forward (logits and gradients, tests/test_hf_models.py). Other causal LMs run
through their own forward, whole: data parallel and FSDP work, a pipeline split is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallel_train.models import hf_context_parallel, hf_tensor_parallel


@dataclass(frozen=True)
class Layout:
    base: str  # the ForCausalLM's attribute holding the decoder ("model", "transformer")
    embeddings: tuple[str, ...]  # the decoder's parts that run before the layers, in order
    layers: str  # its ModuleList of decoder layers
    norm: str  # its final norm
    rotary: str | None = None  # its rotary embedding module (Llama-style), or None
    learned_positions: str | None = None  # its learned position embedding added to the tokens' (GPT-2), or None
    groups: tuple[tuple[str, ...], ...] = field(default=())  # parts that forward uses together: one stage

    def embed(self, base: nn.Module, ids: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """`where`: each token's position (a packed batch's), else 0..T-1."""
        if self.learned_positions is None:
            return getattr(base, self.embeddings[0])(ids)
        tokens, positions, *rest = (getattr(base, name) for name in self.embeddings)
        where = torch.arange(ids.size(1), device=ids.device)[None] if where is None else where.to(ids.device)
        h = tokens(ids) + positions(where)
        for module in rest:  # dropout
            h = module(h)
        return h


ROTARY = Layout(base="model", embeddings=("embed_tokens",), layers="layers", norm="norm", rotary="rotary_emb")
LEARNED = Layout(
    base="transformer",
    embeddings=("wte", "wpe", "drop"),
    layers="h",
    norm="ln_f",
    learned_positions="wpe",
    groups=(("transformer.wte", "transformer.wpe", "transformer.drop"),),
)
LAYOUTS = {"llama": ROTARY, "mistral": ROTARY, "qwen2": ROTARY, "qwen3": ROTARY, "gpt2": LEARNED}
# Mixtures of experts: the same parts, each decoder layer's MLP routed (its router's balancing loss per stage:
# parallel/pipeline/balance.py).
MOE_LAYOUTS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
LAYOUTS.update(dict.fromkeys(MOE_LAYOUTS, ROTARY))


def layout_for(hf_model: nn.Module) -> Layout | None:
    """The layout of this model, if its family is listed and its parts are where the layout says."""
    layout = LAYOUTS.get(hf_model.config.model_type)
    if layout is None:
        return None
    base = getattr(hf_model, layout.base, None)
    names = (*layout.embeddings, layout.layers, layout.norm) + ((layout.rotary,) if layout.rotary else ())
    if base is None or not all(isinstance(getattr(base, n, None), nn.Module) for n in names) or not hasattr(hf_model, "lm_head"):
        return None
    return layout


def pipeline_units(model: nn.Module, layout: Layout) -> dict[str, nn.Module]:
    """The parts in forward order, by their names in the model (`model.layers.3`), for the pipeline splitter."""
    base = getattr(model, layout.base)
    units = {f"{layout.base}.{name}": getattr(base, name) for name in layout.embeddings}
    units.update({f"{layout.base}.{layout.layers}.{key}": layer for key, layer in getattr(base, layout.layers).named_children()})
    units[f"{layout.base}.{layout.norm}"] = getattr(base, layout.norm)
    units["lm_head"] = model.lm_head
    return units


def _device_of(module: nn.Module, default: torch.device) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else default


class LayerInputs:
    """What the decoder layers need besides the hidden states, for one batch: computed once per device (the
    stages of a one-process pipeline sit on different devices) from the model's own rotary module and masks."""

    def __init__(
        self,
        base: nn.Module,
        layout: Layout,
        config: Any,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        padding=None,
        shards: int = 1,
        context_parallel=None,
    ):
        self.base, self.layout, self.config = base, layout, config
        # `shards`: sequence parallel hands the layers 1/shards of the sequence (hf_tensor_parallel.py); attention
        # all-gathers it, so its masks and rotary tables are the whole length's.
        self.batch, self.length, self.dtype = hidden.shape[0], hidden.shape[1] * shards, hidden.dtype
        self.positions = positions  # a packed batch's (B, T), or None: 0..T-1
        self.padding = padding  # a dict batch's attention_mask (B, T), 1 = a real token, or None: no padding
        # parallel.cp > 1: the hidden states are this rank's part of the sequence (`positions` the whole batch's); the
        # attention function exchanges it for the whole (hf_context_parallel.py), so its mask is the whole sequence's.
        self.context_parallel = context_parallel
        self.cache: dict[torch.device, dict[str, Any]] = {}

    def _masks(self, embeds: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        padding = None if self.padding is None else self.padding.to(embeds.device)
        # Position ids go to the masks only when the batch is packed. For 0..T-1 transformers reads them to find
        # there is no packing (a device sync per stage and micro-batch) and then lets SDPA mask causally without a
        # tensor; on fake tensors (the memory estimator) it cannot read them and builds a (B, 1, T, T) mask a run never has.
        packed = None if self.positions is None else self.positions.to(embeds.device)
        args = {"config": self.config, "inputs_embeds": embeds, "attention_mask": padding, "cache": None, "position_ids": packed}
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()) or getattr(self.config, "sliding_window", None):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        return masks

    def _compute(self, device: torch.device) -> dict[str, Any]:
        if self.context_parallel is not None:
            return self._compute_context_parallel(device)
        positions = torch.arange(self.length, device=device)[None] if self.positions is None else self.positions.to(device)
        # Only the shape, dtype and device of the hidden states matter to the masks and the rotary module.
        embeds = torch.empty(self.batch, self.length, 0, dtype=self.dtype, device=device)
        out = {"position_ids": positions, "masks": self._masks(embeds)}
        if self.layout.rotary:
            rotary = getattr(self.base, self.layout.rotary)
            where = next(rotary.buffers(), positions).device  # one rotary module serves stages on every device
            cos, sin = rotary(embeds.to(where), positions.to(where))
            out["position_embeddings"] = (cos.to(device), sin.to(device))
        return out

    def _compute_context_parallel(self, device: torch.device) -> dict[str, Any]:
        cp, whole = self.context_parallel, None if self.positions is None else self.positions.to(device)
        positions = cp.positions(self.length, device, whole)
        positions = positions[None] if whole is None else positions
        mask = hf_context_parallel.whole_mask(whole)
        out = {"position_ids": positions, "masks": {"full_attention": mask}, "context_parallel": cp}
        if self.layout.rotary:
            embeds = torch.empty(self.batch, self.length, 0, dtype=self.dtype, device=device)
            cos, sin = getattr(self.base, self.layout.rotary)(embeds, positions)
            out["position_embeddings"] = (cos, sin)
        return out

    def for_layer(self, index: int, device: torch.device) -> dict[str, Any]:
        if device not in self.cache:
            self.cache[device] = self._compute(device)
        inputs = dict(self.cache[device])
        masks = inputs.pop("masks")
        types = getattr(self.config, "layer_types", None)
        if types:
            kind = types[index]
        else:  # Mistral: every layer slides when the config has a window
            kind = "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"
        inputs["attention_mask"] = masks[kind]
        return inputs


def run_decoder(model: nn.Module, layout: Layout, config: Any, x: torch.Tensor, positions=None, attention_mask=None) -> torch.Tensor:
    """Token ids (or the previous stage's hidden states) -> logits (or this stage's hidden states). `positions`:
    a packed batch's (data/batch.py); `attention_mask`: a dict batch's padding; every stage receives both."""
    base = getattr(model, layout.base)
    h = x
    cp = getattr(model, "context_parallel", None)  # parallel.cp > 1: x is this rank's part of the sequence
    if getattr(base, layout.embeddings[0]) is not None:
        h = layout.embed(base, x, positions if cp is None else cp.positions(x.shape[1], x.device, positions))
        if getattr(model, "lora", False) and torch.is_grad_enabled() and not any(p.requires_grad for p in model.parameters()):
            h.requires_grad_()  # a LoRA pipeline stage with no adapter (the embedding alone): pipelining's backward needs a gradient
    layers = getattr(base, layout.layers)
    first = next(iter(layers), None)
    shards = hf_tensor_parallel.sequence_shards(first) if first is not None else 1
    inputs = LayerInputs(base, layout, config, h, positions, attention_mask, shards, cp) if first is not None else None
    for key, layer in layers.named_children():
        device = _device_of(layer, h.device)
        h = layer(h.to(device), use_cache=False, **inputs.for_layer(int(key), device))
    norm = getattr(base, layout.norm)
    if norm is not None:
        h = norm(h)
    if model.lm_head is not None:
        h = model.lm_head(h)
    return h
