"""LoRA adapters on a Hugging Face causal LM, through peft (model.lora_rank > 0).

    python train.py model.name=hf model.hf_path=FOLDER model.lora_rank=8 [model.lora_alpha=16 model.lora_dropout=0.05
        model.lora_targets=[q_proj,v_proj] | [all-linear] model.lora_experts=true]

`apply` injects peft's LoRA layers into the transformers model in place (`peft.inject_adapter_in_model`): each
targeted Linear becomes a peft `lora.Linear` holding the frozen original as `base_layer` and two small trainable
matrices, `lora_A.default` and `lora_B.default`. With model.lora_experts=true a mixture of experts' routed experts get
adapters too: transformers fuses a layer's experts into 3-d parameters (`mlp.experts.gate_up_proj`, `down_proj`), which
are no Linear, so peft adapts them by name (`target_parameters`, its `lora.ParamWrapper`: rank-r matrices per expert,
held as one `lora_A.default`/`lora_B.default` pair, added to the weight during each forward). Every other weight is frozen, so the optimizer (built over the
parameters that require a gradient, optim.py) holds the adapters only, and so do the checkpoints (models/hf.py
keeps only adapter tensors in the model's state dict): a few MB with their optimizer state, whatever the size of
the base model, which is read again from model.hf_path at every start. A checkpoint therefore names the base model
it needs (`base_identity`: the path and the sha256 of its config.json), and resuming it on another base is a
one-line error.

Meta-device start (parallel/model_init.py): the adapters are built on the meta device with the model, and each rank fills
its own slice. The base weights come from the model's safetensors files under their original names (`aliases`:
`...q_proj.base_layer.weight` is the file's `...q_proj.weight`); the adapters get peft's own initialisation
(`LoraLayer.reset_lora_parameters`: A as nn.Linear's default, B zeros, so training starts from the base model
exactly), drawn under a seed keyed by the matrix's name, so every layout starts from the same adapters.

At the end of a run (hf_export.py): `output_dir/adapter/` (what `peft.PeftModel.from_pretrained(base, DIR)` loads)
and `output_dir/hf/` with the adapters merged into the weights (what `AutoModelForCausalLM.from_pretrained` loads).
Tensor parallelism does not cut peft's layers here: parallel.tp is refused in one line (FSDP2 shards them).
"""

from __future__ import annotations

import hashlib
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import nn

from parallel_train.errors import UserError
from parallel_train.models.hf_moe import is_routed_expert

ADAPTER = "default"  # peft's adapter name: part of every adapter parameter's name (`lora_A.default.weight`)
INSTALL = "pip install -r requirements-hf.txt"


def import_peft():
    try:
        import peft
    except ImportError:
        raise UserError(f"model.lora_rank needs the peft package: {INSTALL}") from None
    return peft


def lora_config(cfg: Any, hf: nn.Module) -> Any:
    """peft's LoraConfig from the model.lora_* keys (targets: peft's default for the architecture when empty) for the
    transformers model `hf` (whose fused experts model.lora_experts names)."""
    peft = import_peft()
    targets = list(cfg.lora_targets) or None
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft's own shorthand: every Linear but the output layer
    experts = expert_parameters(hf, cfg) if getattr(cfg, "lora_experts", False) else None
    return peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets, target_parameters=experts
    )


def expert_parameters(hf: nn.Module, cfg: Any) -> list[str]:
    """The routed experts' fused weights (3-d: experts x in x out), by the names peft matches (`experts.gate_up_proj`)."""
    names = sorted({".".join(n.split(".")[-2:]) for n, p in hf.named_parameters() if is_routed_expert(n) and p.ndim == 3})
    if not names:
        raise UserError(
            f"model.lora_experts: {cfg.hf_path!r} has no fused expert weights (3-d parameters of an `experts` module) for "
            "peft to adapt; set model.lora_experts=false (LoRA on its Linear layers: model.lora_targets)"
        )
    if cfg.lora_dropout:
        raise UserError(
            f"model.lora_dropout={cfg.lora_dropout}: peft's LoRA on the experts' weights (model.lora_experts) has no dropout; "
            "set model.lora_dropout=0"
        )
    return names


def is_adapter(name: str) -> bool:
    """A parameter (or module) name of the LoRA adapters: what trains, and what checkpoints hold."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def apply(hf: nn.Module, cfg: Any) -> dict[str, str]:
    """Inject LoRA into `hf` in place and freeze everything else. Returns {base_layer name: the name in the
    weight files} for the weights peft moved (parallel/model_init.py reads them under their old names)."""
    peft = import_peft()
    before = {name for name, _ in hf.named_parameters()}
    try:
        peft.inject_adapter_in_model(lora_config(cfg, hf), hf, adapter_name=ADAPTER)
    except ValueError as e:  # peft's NoMatchingPeftModuleError, an architecture without a default, a bad key
        raise UserError(f"model.lora_targets: {_first_line(e)} {_linear_names(hf)}") from None
    _check_wrapped(hf, cfg)
    aliases = {}
    for name, p in hf.named_parameters():
        p.requires_grad_(is_adapter(name))
        if ".base_layer." in name and name not in before:  # the experts' wrappers nest: experts.base_layer.base_layer.down_proj
            aliases[name] = re.sub(r"(\.base_layer)+\.", ".", name)
    return aliases


def _check_wrapped(hf: nn.Module, cfg: Any) -> None:
    """What peft wrapped is what this template trains: Linear layers (and GPT-2's Conv1D, which peft wraps as a
    Linear). peft 0.21.2 also wraps an Embedding (`lora.Embedding`, its matrices `lora_embedding_A`/`_B`), but the
    template's adapter handling (which parameters train, their keyed start, checkpoints, exports) covers lora_A and
    lora_B only: an embedding's adapters would stay frozen without a word, and targets matching only embeddings
    would train 0 parameters. Refused in one line naming the modules matched."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    # model.lora_experts' wrappers (ParamWrapper) adapt parameters, not a layer: their lora_A and lora_B train alike
    wrapped = (m for m in hf.named_modules() if isinstance(m[1], LoraLayer) and not isinstance(m[1], ParamWrapper))
    matched = {name: type(m.get_base_layer()).__name__ for name, m in wrapped}
    unsupported = {name: kind for name, kind in matched.items() if kind not in ("Linear", "Conv1D")}
    if unsupported or not matched:
        found = ", ".join(f"{name} ({kind})" for name, kind in sorted((unsupported or matched).items())) or "no module"
        raise UserError(
            f"model.lora_targets={list(cfg.lora_targets) or 'peft default'} matched {found}; LoRA here adapts Linear layers (and "
            f"GPT-2's Conv1D): peft can wrap an Embedding too, but its lora_embedding adapters are not trained here; "
            f"{_linear_names(hf)}"
        )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200].rstrip(".") + ";"


def _linear_names(hf: nn.Module) -> str:
    # GPT-2's Conv1D (transformers' own class) is a Linear with its weight transposed: peft adapts both alike.
    kinds = (nn.Linear,) + tuple({type(m) for m in hf.modules() if type(m).__name__ == "Conv1D"})
    paths = [name.removesuffix(".base_layer").split(".") for name, m in hf.named_modules() if isinstance(m, kinds)]
    names = sorted({p[-1] for p in paths if not any(part.startswith("lora_") for part in p)})  # not peft's own Linears
    return f"this model's Linear layers are {', '.join(names)} (or give all-linear)"


def init_adapter(name: str, module: nn.Module) -> None:
    """peft's initialisation of one adapter matrix (`lora_A.default` or `lora_B.default`, a Linear): its own
    `LoraLayer.reset_lora_parameters` (init_lora_weights=True, the default), run on a stand-in layer that holds
    this matrix and a throwaway partner, so A and B can be filled one at a time under their own seeds."""
    from peft.tuners.lora.layer import LoraLayer

    which = name.split(".")[-2]  # lora_A or lora_B
    partner = nn.Linear(1, 1, bias=False)
    layer = SimpleNamespace(
        lora_A={ADAPTER: module if which == "lora_A" else partner},
        lora_B={ADAPTER: module if which == "lora_B" else partner},
        lora_embedding_A={},
        lora_bias={ADAPTER: False},
        get_base_layer=lambda: partner,  # no tensor-parallel mesh on it: peft's broadcast is skipped
    )
    LoraLayer.reset_lora_parameters(layer, ADAPTER, True)


def is_adapter_module(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B") and parts[-1] == ADAPTER


def config_sha256(hf_path: str) -> str:
    """sha256 of the base model's config.json (its local folder's, or the Hub cache's)."""
    path = Path(hf_path).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(hf_path, "config.json"))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def base_identity(hf_path: str) -> dict[str, str]:
    """What a LoRA checkpoint needs besides itself: the base model, by path and by a hash of its config."""
    return {"hf_path": hf_path, "config_sha256": config_sha256(hf_path)}


def check_same_base(saved: dict[str, str] | None, current: dict[str, str] | None, checkpoint: Path) -> str | None:
    """A one-line error if the checkpoint's adapters were trained on another base model than this run's; a notice
    (returned) if only its path changed. Nothing to check for checkpoints that hold the whole model."""
    if saved is None and current is None:
        return None
    if saved is None or current is None:
        had = "LoRA adapters" if saved is not None else "the whole model (no LoRA)"
        wants = "model.lora_rank > 0" if saved is not None else "model.lora_rank=0"
        raise UserError(f"resume: {checkpoint} holds {had}; resume it with {wants} or start a new output_dir")
    if saved["config_sha256"] != current["config_sha256"]:
        raise UserError(
            f"resume: {checkpoint} holds LoRA adapters of base model {saved['hf_path']!r} (config.json sha256 "
            f"{saved['config_sha256'][:12]}), not of model.hf_path={current['hf_path']!r} (sha256 {current['config_sha256'][:12]}); "
            f"resume with model.hf_path={saved['hf_path']} or start a new output_dir"
        )
    if saved["hf_path"] != current["hf_path"]:
        return (
            f"notice: the checkpoint's base model was {saved['hf_path']!r}; model.hf_path={current['hf_path']!r} has the same config.json"
        )
    return None


def save_and_merge(base: nn.Module, cfg: Any, adapters: dict[str, Any], adapter_out: Path) -> nn.Module:
    """Write the adapters to `adapter_out` in peft's format (adapter_config.json, adapter_model.safetensors: what
    `PeftModel.from_pretrained(base, adapter_out)` loads); return the base with the adapters merged into its weights.
    `base`: the transformers model with its pretrained weights; `adapters`: the trained adapter tensors by the
    template's names (the transformers model's own names with LoRA injected: what peft's wrapper calls
    base_model.model)."""
    peft = import_peft()
    base.name_or_path = cfg.hf_path  # what adapter_config.json names as its base model
    with warnings.catch_warnings():  # peft asks transformers a deprecated question (is_gradient_checkpointing)
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = peft.get_peft_model(base, lora_config(cfg, base), adapter_name=ADAPTER)
    result = wrapped.base_model.model.load_state_dict(adapters, strict=False)
    missing = [k for k in result.missing_keys if is_adapter(k)]
    if missing or result.unexpected_keys:
        raise UserError(
            f"the adapters do not fit model.hf_path {cfg.hf_path!r} with these model.lora_* keys "
            f"(missing {missing[:2]}, unexpected {result.unexpected_keys[:2]}); export from the run that trained them"
        )
    wrapped.save_pretrained(str(adapter_out))
    return wrapped.merge_and_unload()
