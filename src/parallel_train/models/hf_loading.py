"""Loading a model from Hugging Face transformers for the run's task, with one-line errors for what a user can fix.

`model.hf_path` is a local folder (config.json, model.safetensors, tokenizer files: what `save_pretrained`
writes) or a Hub name (e.g. Qwen/Qwen2.5-0.5B, fetched into the Hugging Face cache when online). Weights load
from safetensors only: a pickle (pytorch_model.bin) can run code when it is loaded, and so can a model whose
architecture lives in the folder itself (`trust_remote_code`), which this template never enables.

transformers is an optional dependency (requirements-hf.txt): it is imported here, inside functions, so the
rest of the template runs without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parallel_train.core.task import AUTO_CLASSES
from parallel_train.errors import UserError
from parallel_train.models.ties import with_aliases

INSTALL = "pip install -r requirements-hf.txt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(f"model.name=hf needs the transformers package: {INSTALL}") from None
    transformers.logging.set_verbosity_error()  # its load reports and advice would repeat on every rank
    transformers.logging.disable_progress_bar()
    return transformers


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _looks_local(spec: str) -> bool:
    """A path (not a Hub name `org/name`): starts with / . ~ or has more than one slash."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1


def check_local_folder(hf_path: str) -> Path | None:
    """The model folder if hf_path is local (None: a Hub name). No network and no transformers: the config layer
    calls it, so a wrong folder is named before anything else is loaded from it (its tokenizer, say)."""
    path = Path(hf_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model.hf_path {hf_path!r} is a file; give the folder that holds config.json")
        if not (path / "config.json").is_file():
            raise UserError(f"model.hf_path {hf_path!r} holds no config.json; give a folder written by save_pretrained (or a Hub name)")
        return path
    if _looks_local(hf_path):
        raise UserError(f"model.hf_path {hf_path!r}: no such folder")
    return None


def load_config(hf_path: str) -> Any:
    """The model's transformers config, from a local folder or the Hub; every failure is one line."""
    transformers = import_transformers()
    path = check_local_folder(hf_path)
    source = str(path) if path is not None else hf_path
    try:
        return transformers.AutoConfig.from_pretrained(source, trust_remote_code=False)
    except OSError as e:  # offline, no such repository, or nothing cached
        if path is not None:
            raise UserError(f"model.hf_path {hf_path!r}: config.json is not readable ({_first_line(e)})") from None
        raise UserError(
            f"model.hf_path {hf_path!r} is neither a local folder nor reachable on the Hugging Face Hub ({_first_line(e)})"
        ) from None
    except ValueError as e:  # an unknown model_type, or an architecture that needs its own code
        raise UserError(f"model.hf_path {hf_path!r}: {_first_line(e)}; this template never runs code from a model folder") from None


def check_causal_lm(config: Any, hf_path: str) -> None:
    """Refuse architectures that are not causal (decoder-only) language models: an encoder, a classifier."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    lm_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    causal = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING and (not architectures or any(a in lm_classes for a in architectures))
    if not causal:
        what = ", ".join(architectures) or config.model_type
        raise UserError(
            f"model.hf_path {hf_path!r} is a {what}, not a causal language model; give a decoder-only LM "
            "(Llama, Qwen, Mistral, GPT-2, ...) with a ...ForCausalLM architecture"
        )


def check_weights(hf_path: str) -> None:
    """A local folder asked for its weights (hf_pretrained=true) must hold them as safetensors."""
    path = Path(hf_path).expanduser()
    if not path.is_dir() or any((path / name).is_file() for name in SAFE_WEIGHTS):
        return  # Hub names: from_pretrained fetches the safetensors files
    pickled = [name for name in PICKLED_WEIGHTS if (path / name).is_file()]
    if pickled:
        raise UserError(
            f"model.hf_path {hf_path!r} holds its weights as {pickled[0]} (a pickle, which can run code when loaded); "
            "convert them to model.safetensors (save_pretrained does) or set model.hf_pretrained=false"
        )
    raise UserError(
        f"model.hf_path {hf_path!r} holds no weights (model.safetensors); set model.hf_pretrained=false to start from "
        "random weights, or give the folder that save_pretrained wrote"
    )


def embedding_rows(config: Any) -> int | None:
    """The token embedding's rows; None for a model without one (a vision model)."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    return None if rows is None else int(rows)


def max_positions(config: Any) -> int | None:
    text = config.get_text_config()
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def check_sizes(config: Any, hf_path: str, vocab_size: int, block_size: int, asked_vocab: int = 0) -> None:
    """The tokenizer's ids must fit the embedding, and the context must fit the position table. `asked_vocab`:
    model.vocab_size, which pads a vocabulary the template sizes (GPT) but cannot grow a Hugging Face embedding."""
    rows = embedding_rows(config)
    if rows is None:  # pixels in, no token ids: no vocabulary and no context length to check
        return
    if asked_vocab > rows:
        raise UserError(
            f"model.vocab_size={asked_vocab} exceeds the {rows} embedding rows of model.hf_path {hf_path!r}, whose vocabulary is "
            f"its config.json's; drop model.vocab_size (or set at most {rows})"
        )
    if vocab_size > rows:
        raise UserError(
            f"the tokenizer has {vocab_size} ids but model.hf_path {hf_path!r} embeds only {rows}; "
            "use the model's own tokenizer (data.tokenizer=<the model folder>) or one with at most that many ids"
        )
    positions = max_positions(config)
    if positions and block_size > positions:
        raise UserError(f"model.block_size={block_size} exceeds the {positions} positions of model.hf_path {hf_path!r}; lower it")


def check_task(config: Any, task: str, hf_path: str) -> None:
    """The architecture has a class for the task (model.task's Auto class: AutoModelForSequenceClassification, ...)."""
    if task == "causal-lm":
        check_causal_lm(config, hf_path)
        return
    auto = AUTO_CLASSES[task]
    if type(config) not in getattr(import_transformers(), auto)._model_mapping:
        raise UserError(
            f"model.task={task}: model.hf_path {hf_path!r} is a {config.model_type} model, for which transformers has no "
            f"{auto} class; give a model folder of an architecture that has one, or another model.task"
        )


# Each task's transformers table of model_type -> class (the Auto class of core/task.py AUTO_CLASSES builds from it).
MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}


def tasks_served(config: dict[str, Any]) -> list[str]:
    """The model.task values a model of this config.json (a dict) can train, by transformers' tables: a causal LM only
    when its architectures hold one (a BERT's BertForMaskedLM is not one: check_causal_lm), as check_task decides."""
    from transformers.models.auto import modeling_auto

    kind, architectures = config.get("model_type"), config.get("architectures") or []
    tasks = [task for task, table in MAPPINGS.items() if kind in getattr(modeling_auto, table)]
    lm_classes = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return [t for t in tasks if t != "causal-lm" or not architectures or any(a in lm_classes for a in architectures)]


def set_labels(config: Any, label_names: list[str] | None) -> None:
    """The class names the data gives (Data.label_names): num_labels, id2label and label2id, as transformers' example
    scripts set them before building the model. A pretrained head of another size is then a new head."""
    if label_names:
        config.num_labels = len(label_names)
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: i for i, name in enumerate(label_names)}


# model.attn_implementation -> the flag of a transformers model class that says it has that kernel.
KERNEL_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def check_kernel(config: Any, task: str, attn_implementation: str | None) -> None:
    """The model class has the attention kernel asked for; one line naming eager (which every model has) if not: a
    ResNet has no attention at all, and transformers refuses sdpa, the default, for it."""
    model_class = getattr(import_transformers(), AUTO_CLASSES[task])._model_mapping.get(type(config), None)
    flag = KERNEL_FLAGS.get(attn_implementation or "")
    if model_class is not None and flag and not getattr(model_class, flag, True):
        raise UserError(
            f"model.attn_implementation={attn_implementation}: transformers has no {attn_implementation} attention for "
            f"{model_class.__name__} ({config.model_type}); set model.attn_implementation=eager"
        )


def dropout_keys(config: Any) -> list[str]:
    """The config's dropout probabilities by name, sub-configs' included (text_config.attention_dropout): every
    attribute whose name holds "dropout" or ends in "pdrop" (GPT-2's resid_pdrop) and holds a number or None (BERT's
    classifier_dropout: None follows hidden_dropout_prob)."""
    keys = []
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config (PreTrainedConfig)
            keys += [f"{name}.{k}" for k in dropout_keys(value)]
        elif ("dropout" in name or name.endswith("pdrop")) and (value is None or type(value) in (int, float)):
            keys.append(name)
    return keys


def set_dropout(config: Any, p: float) -> None:
    """model.dropout on a Hub model: every dropout probability its config names (dropout_keys) set to `p` before the
    model is built, as a script's config overrides set them (transformers reads them when it builds the layers)."""
    for key in dropout_keys(config):
        *parents, name = key.split(".")
        node = config
        for parent in parents:
            node = getattr(node, parent)
        setattr(node, name, p)


def build_model(config: Any, task: str, hf_path: str, dtype: str, attn_implementation: str | None = None) -> torch.nn.Module:
    """The task's `AutoModelFor....from_config` (AUTO_CLASSES): the architecture, with random weights (seeded by the caller) or, built
    under model_init.parameters_on_meta, none at all; pretrained weights come from `weight_files`."""
    transformers = import_transformers()
    check_kernel(config, task, attn_implementation)
    try:
        kernel = {"attn_implementation": attn_implementation} if attn_implementation else {}  # None: transformers' default
        return getattr(transformers, AUTO_CLASSES[task]).from_config(config, dtype=DTYPES[dtype], **kernel)
    except (OSError, ValueError, ImportError) as e:  # an attention kernel not installed
        raise UserError(f"model.hf_path {hf_path!r}: {_first_line(e)}") from None


def file_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of safetensors files, read from their headers (no tensor is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})  # noqa: SIM118
    return shapes


def file_keys(model: torch.nn.Module, files: list[Path]) -> dict[str, str]:
    """{the model's name: the name in the files} where the two differ, as from_pretrained renames them: transformers'
    own renamings of older checkpoints (a ViT's `encoder.layer.0.attention.attention.query` is `layers.0.attention.q_proj`
    now, Mixtral's `block_sparse_moe.gate` is `mlp.gate`) and the base model's prefix (a BertModel's `embeddings...` is a
    classifier's `bert.embeddings...`). Tensors that transformers makes from several (a layer's experts, fused) are
    hf_conversions.py's."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    names = {}
    for key in file_shapes(files):
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted is None and name != key and name in meta:
            names[name] = key
    return names


def new_weights(
    model: torch.nn.Module, files: list[Path], aliases: dict[str, str], converted: dict[str, tuple[int, ...]] | None = None
) -> list[str]:
    """The model's weights that the files do not give, as from_pretrained finds them: absent (a new head on a
    pretrained body: `classifier.weight`) or of another shape (a classifier of another number of labels). They start
    from transformers' own initialisation. Tensors of the files that the model lacks (a masked-LM head) are ignored.
    `aliases`: {name: the name whose tensor it starts as} (tied weights, renamed ones, an untied lm_head); `converted`: the
    shapes of the tensors transformers makes from several of the files' (hf_conversions.py: fused experts)."""
    shapes = {**file_shapes(files), **(converted or {})}

    def source(name: str) -> str:
        for _ in range(len(aliases) + 1):  # a tied alias's owner may itself be stored under another name
            if name in shapes or name not in aliases:
                return name
            name = aliases[name]
        return name

    return [name for name, t in model.state_dict().items() if shapes.get(source(name)) != tuple(t.shape)]


def weight_files(hf_path: str) -> list[Path]:
    """The model's safetensors files: in its local folder (model.safetensors, or the shards its index lists), or
    fetched from the Hub into the Hugging Face cache (safetensors and JSON only: never a pickle, never code)."""
    check_weights(hf_path)
    path = Path(hf_path).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(hf_path, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as e:  # offline and not cached, no such repository, ...
            raise UserError(
                f"model.hf_path {hf_path!r}: its weights are neither cached nor reachable on the Hub ({_first_line(e)})"
            ) from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        return sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"model.hf_path {hf_path!r} holds no weights (model.safetensors); set model.hf_pretrained=false")
    return files


def load_whole(model: Any) -> None:
    """A pretrained model built whole (tests, scripts; a run starts on the meta device instead, parallel/model_init.py):
    its folder's weights loaded now, converted, aliased and grown as the meta start reads them."""
    from safetensors.torch import load_file

    state = {}
    for f in model.pretrained_files():
        state.update(load_file(str(f)))
    if model.weight_conversions:  # a mixture of experts' fused experts, from the per-expert tensors (hf_conversions.py)
        state.update(model.weight_conversions.read_all())
    # An untied lm_head starts as the embedding; a tied one is the embedding (save_pretrained stores it once).
    state = with_aliases(with_aliases(state, model.weight_aliases), model.tied)
    state = {k: v for k, v in state.items() if k not in model.new_weights}  # these keep their fresh initialisation
    own = model.state_dict()
    for name, rows in model.grown_weights.items():  # a grown head: the files' rows, then its own new ones
        state[name] = torch.cat([state[name][:rows].to(own[name].dtype), own[name][rows:]])
    missing = [n for n in own if n not in state and n not in model.new_weights]
    if missing:
        raise UserError(
            f"model.hf_path {model.hf_path!r}: its weights lack {missing[0]!r} ({len(missing)} tensors); was it saved by save_pretrained?"
        )
    model.load_state_dict(state, strict=False)
