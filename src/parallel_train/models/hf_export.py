"""A trained model.name=hf model as a Hugging Face model folder: what the task's Auto class (AutoModelForCausalLM,
AutoModelForSequenceClassification, ...: core/task.py AUTO_CLASSES) and `AutoTokenizer.from_pretrained` load.

    output_dir/hf/config.json               the model's config (untied if model.untie_embeddings=true; a classifier's
                                            num_labels, id2label and label2id: the run's class names)
    output_dir/hf/model.safetensors         the trained weights, the model's own parameter names
    output_dir/hf/generation_config.json    when the model has one
    output_dir/hf/tokenizer.json, ...       the run's tokenizer, where it has a Hugging Face form
    output_dir/hf/preprocessor_config.json  model.hf_path's image processor (an image classifier's), copied

The trainer writes it at the end of a model.name=hf run; scripts/export.py --format hf writes it from any run or
checkpoint. A LoRA run (model.lora_rank, hf_lora.py) holds only its adapters: the folder then holds the base model
with the adapters merged into its weights, and a second folder beside it (`adapter_folder`) the adapters alone in
peft's format. The weights are the template's canonical state dict, which for this model already carries the
transformers names, so nothing is renamed: the model is built on the meta device (no memory, no random init),
the weights are assigned to it, and `save_pretrained` writes them (sharded above 5 GB, the tied weight once).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from parallel_train.errors import UserError
from parallel_train.models import hf_loading, hf_lora

# An image classifier's image processor (what turns an image into pixel_values), copied from model.hf_path.
PROCESSOR_FILES = ("preprocessor_config.json",)


def build_empty(cfg: Any, dtype: str, label_names: list[str] | None = None) -> Any:
    """The run's transformers model with no weights (meta device), its config as the run trained it."""
    config = hf_loading.load_config(cfg.hf_path)
    if cfg.untie_embeddings:
        config.get_text_config().tie_word_embeddings = False
    config.use_cache = True  # the exported model is for inference: generate() uses the cache
    hf_loading.set_labels(config, label_names)
    with torch.device("meta"):
        return hf_loading.build_model(config, cfg.task, cfg.hf_path, dtype)


def load_weights(model: Any, state: dict[str, torch.Tensor], source: str) -> None:
    """Assign the trained tensors to the empty model; the tied alias (lm_head.weight) follows its weight."""
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a size mismatch: a classifier's head without the run's class names (label_names.json)
        mismatch = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise UserError(
            f"{source} does not fit the model of model.hf_path ({mismatch[:200]}); export from the run that trained it, "
            "with its label_names.json beside the checkpoint for a classifier"
        ) from None
    model.tie_weights()
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing or result.unexpected_keys:
        raise UserError(
            f"{source} does not fit the model of model.hf_path (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}); "
            "export from the run that trained it"
        )


def byte_tokenizer() -> Any:
    """data.tokenizer=byte as a Hugging Face tokenizer: id i is byte i (byte-level BPE with no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def hf_tokenizer(tokenizer: Any, hf_path: str = "") -> Any | None:
    """The run's tokenizer in its Hugging Face form, or None (a char vocabulary has none). When it is the model
    folder's own tokenizer.json, the folder's tokenizer is saved whole: its special tokens and chat template too."""
    own = Path(hf_path) / "tokenizer.json"
    core = getattr(tokenizer, "tokenizer", None)  # a tokenizers.Tokenizer (a tokenizer.json, bpe:N)
    if core is not None and own.is_file() and (Path(hf_path) / "tokenizer_config.json").is_file():
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(own)).to_str() == core.to_str():  # the folder's own: the same tokenizer.json
            return hf_loading.import_transformers().AutoTokenizer.from_pretrained(hf_path)
    kind = getattr(tokenizer, "kind", None)
    if kind == "byte":
        return byte_tokenizer()
    if core is not None:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=core)
    return None


def adapter_folder(out: Path) -> Path:
    """Where a LoRA run's adapters go beside the merged folder: output_dir/adapter next to output_dir/hf, else
    OUT-adapter next to OUT."""
    out = Path(out)
    return out.with_name("adapter") if out.name == "hf" else out.with_name(f"{out.name}-adapter")


def export_pretrained(
    cfg: Any,
    state: dict[str, torch.Tensor],
    out: Path,
    tokenizer: Any,
    source: str = "the run's weights",
    dtype: str | None = None,
    base: Any = None,
    chat_files: dict[str, str] | None = None,
    label_names: list[str] | None = None,
) -> str:
    """Write the folder `out` (new or empty: checkpoint/writer.py's `write_folders` writes it beside the old one and
    replaces it whole), its weights in `dtype` (default: as trained).
    `base`: for a LoRA run, the transformers model with its pretrained weights, into which `state` (the adapters)
    is merged; the adapters alone go to `adapter_folder(out)`. `chat_files`: the chat template the run trained with
    and its tokenizer config (data/chat_format.py), which replace the model folder's (data.chat_template may have given
    another). `label_names`: the run's class names (id2label). Returns one line saying what was written."""
    dtype = dtype or cfg.dtype
    out, extra = Path(out), ""
    if base is None:
        model = build_empty(cfg, dtype, label_names)
        load_weights(model, {k: v.to(hf_loading.DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}, source)
    else:
        adapters = adapter_folder(out)
        model = hf_lora.save_and_merge(base, cfg, state, adapters).to(hf_loading.DTYPES[dtype])
        model.config.use_cache = True  # for inference: generate() uses the cache
        extra = f" (LoRA adapters merged into the weights); the adapters alone, for peft: {adapters}"
    saved = hf_tokenizer(tokenizer, cfg.hf_path)
    model.save_pretrained(out)
    for name in PROCESSOR_FILES:  # an image classifier's image processor (a local folder's; not fetched from the Hub)
        if (Path(cfg.hf_path) / name).is_file():
            shutil.copyfile(Path(cfg.hf_path) / name, out / name)
    if saved is not None:
        saved.save_pretrained(out)
        for name, text in (chat_files or {}).items():
            (out / name).write_text(text, encoding="utf-8")
    note = "" if saved is not None or tokenizer is None else " (no tokenizer files: the run's tokenizer has no Hugging Face form)"
    return f"Hugging Face model folder: {out}{extra}{note}"
