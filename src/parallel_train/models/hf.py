"""A model from Hugging Face transformers, for any task of model.task, as a template model (model.name=hf).

    python train.py model.name=hf model.hf_path=PATH_OR_HUB_NAME data.tokenizer=PATH_OR_HUB_NAME
    python train.py model.name=hf model.task=sequence-classification model.hf_path=A_BERT_FOLDER ...

`HFModel` builds the task's Auto class (core/task.py AUTO_CLASSES: AutoModelForCausalLM, ...ForSequenceClassification,
...ForTokenClassification, ...ForMaskedLM, ...ForSeq2SeqLM, ...ForImageClassification) from the folder's config.json
and loads its weights (model.hf_pretrained=true: fine-tune them) or keeps random ones (false: pre-train), and gives it
the template's model contract:
- `forward(x, positions=None, **inputs) -> logits`: x is the task's main input (input_ids, pixel_values), `inputs`
  the batch's others (attention_mask, token_type_ids, decoder_input_ids, ...), so the task's loss, metrics and the
  sampler apply unchanged;
- a pretrained body given a new head (a classifier the folder lacks), as transformers fine-tunes: the head starts
  from transformers' own initialisation, named in one notice line (`notice`); weights of the folder the task's model
  lacks (a masked-LM head) are ignored. Class names (Data.label_names) set num_labels, id2label and label2id before it
  is built; a head the folder holds keeps each row's name, grows rows for new names, or starts anew with
  model.new_head=true (hf_head.py);
- parameter names are the transformers model's own (`model.layers.0.self_attn.q_proj.weight`): the adapter
  registers the model's children under their own names, so checkpoints hold a Hugging Face state dict and the
  export (`output_dir/hf/`, hf_export.py) is a save without renaming;
- `pipeline_units()`: the parts in forward order (embeddings, each decoder layer, final norm, lm_head) for the
  pipeline splitter, which sets the parts a stage does not hold to None; `forward` then runs only the others
  (hf_layouts.py: Llama-, Mistral-, Qwen- and GPT-2-style decoders; causal LMs only);
- `_no_split_modules` (the decoder layer class: the unit FSDP wraps; accelerate reads it too; `decoder_layers()`
  lists them) and `tensor_parallel_plan(tp)` (transformers' own plan for the model, as torch ParallelStyles) for
  the sharding engines.

Tied embeddings (GPT-2, some Llamas: lm_head.weight is the input embedding) are handled as any model's tie
(models/ties.py): one tensor under data parallelism and FSDP, exactly as transformers trains them; a copy on each pipeline
stage that holds a name of it, kept equal by summing their gradients (parallel/pipeline/tied.py); stored once in
checkpoints, under its first name; refused under tensor parallelism. model.untie_embeddings=true gives lm_head its
own copy instead (trained separately, exported untied).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_train.core.fields import check, opt
from parallel_train.core.model_config import ModelConfig
from parallel_train.core.task import DEFAULT, LABELLED, TASK_NAMES
from parallel_train.errors import UserError
from parallel_train.models import (
    hf_context_parallel,
    hf_conversions,
    hf_export,
    hf_head,
    hf_init,
    hf_layouts,
    hf_loading,
    hf_lora,
    hf_moe,
    hf_tensor_parallel,
)
from parallel_train.models.activation_checkpoint import Checkpointing, check_option, mode_field, option_field
from parallel_train.models.ties import find_ties


@dataclass
class HFConfig(ModelConfig):
    """The keys of model.name=hf (model.<key>=value), beside the keys every model has."""

    hf_path: str = opt("", "a local folder written by save_pretrained (config.json, weights) or a Hugging Face Hub name")
    hf_pretrained: bool = opt(True, "load its weights (fine-tune); false: random weights from its config.json (pre-train)")
    dtype: str = opt(
        "float32", "dtype of the weights (and optimizer state); bf16 compute: train.mixed_precision=bf16", choices=tuple(hf_loading.DTYPES)
    )
    attn_implementation: str = opt(
        "sdpa",
        "transformers attention kernel (packed samples kept apart by each: flash_attention_2 and flex_attention on GPUs); "
        "eager for a model without sdpa (a ResNet)",
        choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
    )
    dropout: float | None = opt(
        None, "every dropout probability its config names (hidden, attention, classifier, ...); unset: the folder's own", min=0.0, below=1.0
    )
    untie_embeddings: bool = opt(False, "give lm_head its own copy of a tied input embedding (trained apart, exported untied)")
    new_head: bool = opt(
        False, "a classifier: start its head anew with the data's class names; false: its rows keep their names (hf_head.py)"
    )
    activation_checkpointing: str = mode_field()  # none | full | selective, per decoder layer (models/activation_checkpoint.py)
    selective_ac: str = option_field()
    moe_aux_loss_coef: float = opt(
        -1.0,
        "a MoE model: weight of the router's balancing loss over the data-parallel batch; -1: its router_aux_loss_coef; 0: off",
        min=-1.0,
    )
    lora_rank: int = opt(0, "LoRA (peft): 0 trains every weight; R > 0 freezes them and trains rank-R adapters", min=0, max=65536)
    lora_alpha: float = opt(16.0, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank", above=0.0)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input", min=0.0, below=1.0)
    lora_targets: list[str] = opt(
        [], "LoRA: the modules to adapt, by name ([q_proj,v_proj]) or [all-linear]; []: peft's default for the architecture"
    )
    lora_experts: bool = opt(False, "LoRA on a MoE's routed experts too: their fused weights, through peft's target_parameters")

    tasks = TASK_NAMES  # every task: the Auto class of model.task builds the model

    @property
    def inputs(self) -> str:  # what forward takes (checked against Data.inputs): pixels for an image classifier
        return "pixel values" if self.task == "image-classification" else "token ids"

    # Keys that mean nothing for another model, and why: given with another model.name they are an error, not a notice.
    exclusive = dict.fromkeys(
        ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_experts"), "LoRA adapts a pretrained Hugging Face model"
    )

    def check(self) -> None:
        check(bool(self.hf_path), "model.hf_path: give a local model folder or a Hub name, e.g. model.hf_path=Qwen/Qwen2.5-0.5B")
        hf_loading.check_local_folder(self.hf_path)
        check_option(self.selective_ac)
        check(
            not self.lora_rank or self.hf_pretrained,
            "model.lora_rank: LoRA adapts pretrained weights, which checkpoints do not hold; keep model.hf_pretrained=true",
        )

    def head_label_names(self) -> list[str] | None:
        """The class names of the pretrained head this run keeps, which the data's class ids follow (hf_head.py)."""
        return hf_head.head_names(self) if self.task in LABELLED else None

    def own_tokenizer(self) -> str | None:
        if self.task == "image-classification":
            return None  # pixels: no tokenizer (its image processor is the folder's preprocessor_config.json)
        return self.hf_path  # its folder's tokenizer.json (or the Hub repository's)


class HFModel(nn.Module):
    Config = HFConfig  # its keys: what model.name=hf accepts

    def __init__(self, cfg: HFConfig, vocab_size: int, label_names: list[str] | None = None):
        """`label_names`: a task with labels' class names (Data.label_names): the head's size, id2label and label2id."""
        super().__init__()
        config = hf_loading.load_config(cfg.hf_path)
        folder_names = [config.id2label[i] for i in range(len(config.id2label))]  # the pretrained head's rows, if it has one
        self.task = cfg.task
        hf_loading.check_task(config, cfg.task, cfg.hf_path)
        hf_loading.check_sizes(config, cfg.hf_path, vocab_size, cfg.block_size, cfg.vocab_size)
        hf_loading.set_labels(config, label_names)
        if cfg.dropout is not None:
            hf_loading.set_dropout(config, cfg.dropout)
        hf = hf_loading.build_model(config, cfg.task, cfg.hf_path, cfg.dtype, cfg.attn_implementation)
        # Weights whose first values are another's in the files: stored under an older name (hf_loading.file_keys), an
        # untied lm_head that starts as the embedding, a LoRA-wrapped layer's base weight.
        files = hf_loading.weight_files(cfg.hf_path) if cfg.hf_pretrained else []  # found once (a Hub name: fetched once)
        self.__dict__["weight_files"] = files
        self.__dict__["weight_aliases"] = hf_loading.file_keys(hf, files) if files else {}
        # Tensors transformers makes from several of the files' (a mixture of experts' fused experts): read by its converters.
        self.__dict__["weight_conversions"] = hf_conversions.ConvertedTensors(hf, files) if files else None
        if cfg.untie_embeddings and find_ties(hf):
            self._alias(find_ties(hf))
            hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone())
            hf.config.get_text_config().tie_word_embeddings = False
        checkpointing = Checkpointing(cfg.activation_checkpointing, cfg.selective_ac)
        if checkpointing.mode != "none" and not hf.supports_gradient_checkpointing:
            raise UserError(
                f"model.activation_checkpointing={checkpointing.mode}: transformers cannot checkpoint the layers of "
                f"{type(hf).__name__} ({config.model_type}); set model.activation_checkpointing=none"
            )
        if checkpointing.mode != "none":  # transformers checkpoints each decoder layer's forward (FSDP2's hooks stay outside)
            hf.activation_checkpointing_enable(
                activation_checkpointing_kwargs=checkpointing.kwargs(), every_n_layers=checkpointing.every_n_layers()
            )
        hf.config.use_cache = False  # training: no key/value cache
        self.__dict__["hf"] = hf
        self._register_parts()
        self.hf_path, self.pretrained = cfg.hf_path, cfg.hf_pretrained
        self.lora = False  # set once the adapters are in (below): from then on checkpoints hold them only
        self.block_size = cfg.block_size
        self.context_parallel = None  # parallel.cp > 1: which part of each sequence this rank holds (use_context_parallel)
        self.layout = hf_layouts.layout_for(hf) if self.task == DEFAULT else None  # the layouts are causal LMs'
        self.main_input = hf.main_input_name  # what x is: input_ids, pixel_values
        self.pipeline_groups = self.layout.groups if self.layout else ()
        self._no_split_modules = list(getattr(hf, "_no_split_modules", None) or [])
        self.tp_plan = dict(getattr(hf, "tp_plan", None) or {})
        self.tied = find_ties(hf)  # {lm_head.weight: the input embedding's name} when tied
        self._register_state_dict_hook(_adapters_only)
        self.register_load_state_dict_post_hook(_base_not_missing)
        self.train()
        fresh = hf_head.start_weights(self, label_names, folder_names, cfg.new_head) if self.pretrained else ([], {}, None)
        self.new_weights, self.grown_weights, self.notice = fresh  # grown: {name: the rows its files give}
        # LoRA freezes every weight but its adapters, and checkpoints hold only those: a new or grown head would stay as it starts
        if cfg.lora_rank and (self.new_weights or self.grown_weights):
            raise UserError(
                f"model.lora_rank: the new model.task={self.task} head ({', '.join([*self.new_weights, *self.grown_weights][:2])}) would stay frozen at its "
                "random start and not be saved; train every weight (model.lora_rank=0), or start from a folder that holds the head"
            )
        if self.pretrained and not next(self.parameters()).is_meta:  # built whole (tests, scripts): load its weights now
            hf_loading.load_whole(self)
        if cfg.lora_rank:  # after the pretrained weights: peft wraps the loaded Linear layers as they are
            self._alias(hf_lora.apply(hf, cfg))
            self._register_parts()  # a targeted child of the model itself (lm_head) is a new module now
            self.lora = True
            self.lora_base = hf_lora.base_identity(cfg.hf_path)
        # Taken now, before any split or shard: the parents whose rules reach into a module's parameters (hf_init.py).
        self.__dict__["init_tree"] = hf_init.InitTree(hf)

    def _alias(self, aliases: dict[str, str]) -> None:
        """Add {name: the name it starts as}, through any name that is itself stored under another."""
        self.weight_aliases.update({name: self.weight_aliases.get(source, source) for name, source in aliases.items()})

    def _register_parts(self) -> None:
        """The transformers model is not a submodule: its children are, under their own names (so parameter
        names are its own)."""
        for name, child in self.hf.named_children():
            self.add_module(name, child)

    def base_model(self) -> dict[str, str] | None:
        """The base model a LoRA checkpoint needs (hf_lora.py), None when checkpoints hold the whole model."""
        return self.lora_base if self.lora else None

    def pretrained_files(self) -> list[Path] | None:
        """The safetensors files the first weights come from (parallel/model_init.py reads each rank's slices), or None for
        random weights (hf_pretrained=false)."""
        return self.weight_files if self.pretrained else None

    def init_weights(self, name: str, module: nn.Module) -> None:
        """transformers' own initialisation of one module, as from_config gives it (its own rule and its parents',
        hf_init.py), for random weights and for what the weight files lack (rotary tables and other non-persistent
        buffers); peft's own for a LoRA matrix."""
        if hf_lora.is_adapter_module(name):
            hf_lora.init_adapter(name, module)
        else:
            self.init_tree.apply(name, module)

    @property
    def config(self) -> Any:
        return self.hf.config

    def train(self, mode: bool = True) -> HFModel:
        super().train(mode)  # every part (they are the transformers model's children)
        self.hf.training = mode  # and the transformers model itself, which its own forward may consult
        return self

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **inputs: torch.Tensor
    ) -> torch.Tensor:
        """The task's main input (token ids (B, T), pixels (B, C, H, W)) and the batch's other inputs (attention_mask,
        token_type_ids, decoder_input_ids, ...) -> logits ((B, T, vocab), (B, classes), ...). A pipeline stage may lack
        some parts (hf_layouts.py). `positions`: a packed batch's (data/batch.py), given to the model as position_ids,
        from which transformers' attention masks keep the samples apart. `attention_mask` is named (not only in
        **inputs) because the pipelines pass every stage the inputs its forward names: each stage builds its layers'
        masks from it (hf_layouts.run_decoder)."""
        if self.layout is not None and not inputs:  # a causal LM's parts, whole or one pipeline stage's
            return hf_layouts.run_decoder(self, self.layout, self.hf.config, x, positions, attention_mask)
        if attention_mask is not None:
            inputs = {**inputs, "attention_mask": attention_mask}
        if positions is not None:
            if "position_ids" not in inspect.signature(self.hf.forward).parameters:
                raise UserError(
                    f"data.packing: model.hf_path {self.hf_path!r} ({self.hf.config.model_type}) takes no position_ids, so packed "
                    "samples cannot be kept apart; set data.packing=false"
                )
            inputs = {**inputs, "position_ids": positions}
        return self.hf(**{self.main_input: x}, **inputs).logits

    def use_context_parallel(self, cp) -> None:
        """parallel.cp > 1: the inputs are this rank's part of each sequence; attention exchanges them (hf_context_parallel.py)."""
        hf_context_parallel.use(self, cp)

    # What accelerate's FSDP2 preparation asks of a transformers model (its embeddings get FSDP units of their own).
    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.hf.get_output_embeddings()

    def tie_weights(self) -> None:
        if self.tied:
            self.hf.tie_weights()

    def decoder_layers(self) -> list[nn.Module]:
        """The modules FSDP shards one by one: every instance of the classes in `_no_split_modules`, but one holding a
        tied weight (a BERT's embeddings, whose word embedding is its masked-LM decoder's weight), which stays with the
        root: FSDP2 shards a weight in one group only."""
        tied = set(self.tied) | set(self.tied.values())
        return [
            m
            for name, m in self.named_modules()
            if type(m).__name__ in self._no_split_modules
            and not any(f"{name}.{p}" in tied for p, _ in m.named_parameters(remove_duplicate=False))
        ]

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """How `parallel.tp` ranks cut this model, for `parallelize_module`: transformers' own plan for it, in torch
        ParallelStyles, over the modules this model (or pipeline stage) holds (hf_tensor_parallel.py)."""
        what = f"model.hf_path {self.hf_path!r}"
        if self.lora:
            raise UserError(
                f"parallel.tp={tp}: tensor parallelism does not cut peft's LoRA layers here (model.lora_rank); "
                "shard the model with FSDP2 instead (parallel.dp_shard)"
            )
        if self.tied:
            raise UserError(
                f"parallel.tp={tp}: {what} ties lm_head to its input embedding, which tensor parallelism cuts two ways; "
                "set model.untie_embeddings=true (lm_head gets its own copy)"
            )
        if self.task != DEFAULT and self.tp_plan:  # the sequence-parallel regions here are a causal LM's (hf_tensor_parallel.py)
            raise UserError(
                f"parallel.tp={tp}: model.task={self.task}: tensor parallelism cuts causal language models only here; "
                "shard it with FSDP (parallel.dp_shard) instead"
            )
        # Sequence parallel where the layout runs the layers (it builds their inputs for the whole length): decided on the
        # whole transformers model, so every pipeline stage cuts alike.
        sequence = self.layout is not None and hf_tensor_parallel.sequence_parallel_fits(self.hf, self.tp_plan)
        return hf_tensor_parallel.tensor_parallel_plan(self, self.tp_plan, self.hf.config, tp, what, sequence)

    @property
    def splits_into_stages(self) -> bool:
        """Whether pipeline_units can cut this model (a causal LM of a known layout); the memory estimator counts
        the others by their FSDP units (parallel/parts.py counted_units)."""
        return self.task == DEFAULT and self.layout is not None

    def pipeline_units(self) -> dict[str, nn.Module]:
        """The parts the pipeline splitter cuts between, in forward order (parallel/pipeline/split.py)."""
        what = f"model.hf_path {self.hf_path!r} ({self.hf.config.model_type})"
        if self.task != DEFAULT:
            raise UserError(
                f"model.task={self.task}: pipeline stages split causal language models only here ({what}); train it without "
                "pipeline stages (data parallel, or FSDP2 with parallel.dp_shard)"
            )
        if self.layout is None:
            known = ", ".join(sorted(hf_layouts.LAYOUTS))
            raise UserError(
                f"{what}: no pipeline layout for this architecture (known: {known}); train it without pipeline stages "
                "(data parallel or FSDP), or add its layout in src/parallel_train/models/hf_layouts.py"
            )
        units = hf_layouts.pipeline_units(self, self.layout)
        placed = {id(p) for unit in units.values() for p in unit.parameters()}
        stray = [name for name, p in self.named_parameters() if id(p) not in placed]
        if stray:
            raise UserError(
                f"{what}: parameters outside the pipeline layout's parts ({', '.join(stray[:3])}); train it without pipeline stages"
            )
        return units

    def active_params(self) -> int:
        """The parameters one token uses: all of them but, in a mixture of experts, the routed experts it is not sent to
        (hf_moe.py). The start banner names them when fewer than all."""
        return sum(p.numel() for p in self.parameters()) - hf_moe.unused_params(self)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per active parameter (active_params: a mixture of experts runs top-k of its routed
        experts per token) plus attention (PaLM appendix B). The input embedding is a lookup, not a matmul, so it counts
        only as lm_head where the two share one weight."""
        text = self.hf.config.get_text_config()
        n_params = self.active_params()  # a tied weight once
        embedding = self.hf.get_input_embeddings()
        if not self.tied and isinstance(embedding, nn.Embedding):  # a vision model's patch embedding is a matmul
            n_params -= embedding.weight.numel()
        # A frozen weight (LoRA's base) costs its forward and the gradient of its input, not its own: 4 per parameter.
        frozen = sum(p.numel() for p in self.parameters() if not p.requires_grad) - hf_moe.unused_params(self, frozen=True)
        layers = getattr(text, "num_hidden_layers", 0) + getattr(text, "num_decoder_layers", 0)  # an encoder-decoder: both stacks
        return 6 * n_params - 2 * frozen + 12 * layers * getattr(text, "hidden_size", 0) * self.block_size

    @staticmethod
    def export(cfg: HFConfig, state: dict[str, torch.Tensor], out: Path, tokenizer: Any, **options: Any) -> str:
        """Write `out` as a Hugging Face model folder (hf_export.py); returns a line saying what was written. A LoRA
        run's `state` is its adapters: they are merged into the base model, read again from model.hf_path, and
        written alone beside it too. `options`: export_pretrained's source, dtype and chat_files."""
        base = None
        if cfg.lora_rank:
            plain = dataclasses.replace(cfg, lora_rank=0, activation_checkpointing="none")
            base = HFModel(plain, hf_loading.embedding_rows(hf_loading.load_config(cfg.hf_path))).hf
        return hf_export.export_pretrained(cfg, state, out, tokenizer, base=base, **options)


# Its name while it served causal LMs only, which scripts and tests of that time use.
HFCausalLM = HFModel


def _adapters_only(module: HFModel, state: dict, prefix: str, local_metadata: Any) -> None:
    """With LoRA a state dict holds the adapters only: the frozen base is read from model.hf_path at every start,
    so checkpoints need not hold it."""
    if module.lora:
        for key in [k for k in state if k.startswith(prefix) and not hf_lora.is_adapter(k[len(prefix) :])]:
            del state[key]


def _base_not_missing(module: HFModel, incompatible: Any) -> None:
    """Loading a LoRA checkpoint: the frozen base is not missing (it comes from model.hf_path)."""
    if module.lora:
        for key in [k for k in incompatible.missing_keys if not hf_lora.is_adapter(k)]:
            incompatible.missing_keys.remove(key)
