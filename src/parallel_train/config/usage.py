"""Which keys each choice reads: one row per key that only some choices (data format, model, optimizer, schedule,
mesh...) read, so that a key the user set is never dropped without a word.

`load_config` asks `unread(cfg, keys)` about the keys the user set (YAML files and overrides, never defaults, never
a saved config) whose value is not the default: each one whose row says the run does not read it is listed in ONE
start notice, or refused in one line where the row says ignoring it would train something else than the user
clearly asked for. A key set to its default changes nothing, read or not (a saved config.yaml given as --config
lists them all). Keys of another model (model.<key> of model.name=gpt given with model.name=mlp) join the same notice
(config/load.py). A new key that only some choices read is one more row here; docs/configuration.md lists the table
(a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parallel_train.core.fields import fields_of
from parallel_train.core.task import LABELLED
from parallel_train.errors import UserError

SAMPLES = "data.format=chat or instruction"
DECAYING = "train.lr_schedule=cosine, linear or wsd"
TRANSLATIONS = "model.task=seq2seq on rows of a `translation` dict (not a target column)"
FULL_WINDOWS = f"applies to samples ({SAMPLES}), not to windows of text (data.format=text), which are full already"


@dataclass(frozen=True)
class Row:
    key: str  # section.key, as the user writes it
    when: str  # the choice under which the key is read, as the notice names it
    reads: Callable[[Any], bool]  # Config -> whether this run reads the key
    refuse: str = ""  # non-empty: a value other than the default, unread, is an error; this says why and what to do


def _text_source(c: Any) -> bool:
    """The built-in `text` source: a custom data.source reads whatever data.* keys it likes."""
    return c.data.source == "text"


def _tokens(c: Any) -> bool:
    """Data that is tokenized: not random features, not synthetic ids."""
    return c.data.path not in ("random", "synthetic")


# The tasks whose rows are read by the task itself (tasks/text_rows.py), in its own columns.
TEXT_TASKS = ("sequence-classification", "token-classification", "masked-lm", "seq2seq")


def _task(*tasks: str) -> Callable[[Any], bool]:
    """Read under these model.task values (or by a data source of your own, which reads what it likes)."""
    return lambda c: not _text_source(c) or c.model.task in tasks


def _translations(c: Any) -> bool:
    """seq2seq rows of translation dicts (tasks/seq2seq.py), not of a target column. Imported late: it reads the
    first row of data.path."""
    from parallel_train.tasks.seq2seq import reads_languages

    return reads_languages(c)


def _own_validation(c: Any) -> bool:
    """The data brings its validation split: prepared or streamed data, data.path=random (a draw of its own), or a
    folder with a validation split that a text task or an imagefolder reads (a causal LM's text splits by fraction)."""
    from parallel_train.tasks.text_rows import has_validation_split  # imported late: it lists the folder

    d = c.data
    if d.streaming or d.path == "random" or _prepared(c):
        return True
    return c.model.task in (*TEXT_TASKS, "image-classification") and has_validation_split(d.path)


def _prepared(c: Any) -> bool:
    from parallel_train.data.prepared import is_prepared  # the same floor; imported late: it brings numpy and torch

    return is_prepared(c.data.path)


def _lora(c: Any) -> bool:
    return getattr(c.model, "lora_rank", 0) > 0


# Without lora_rank these keys change nothing and every weight trains: a full fine-tune the user did not ask for.
FULL_FINE_TUNE = (
    "set, but model.lora_rank=0, so no adapters are made and every weight would train (a full fine-tune); "
    "set model.lora_rank=R (e.g. 8) for LoRA, or drop it"
)


def _experts(c: Any) -> bool:
    """The GPT's experts are on (models/moe.py); a model without model.n_experts reads its own keys as it likes."""
    return getattr(c.model, "n_experts", 1) > 0


def _pipeline(c: Any) -> bool:
    return c.parallel.pipeline_stages > 1


ROWS: tuple[Row, ...] = (
    Row(
        "data.chat_template",
        SAMPLES,
        lambda c: c.data.format != "text",  # whatever the source: refused as before the table
        refuse=FULL_WINDOWS,
    ),
    Row(
        "data.packing",
        SAMPLES,
        lambda c: c.data.format != "text",  # whatever the source: refused as before the table
        refuse=FULL_WINDOWS,
    ),
    Row("data.truncate", SAMPLES, lambda c: not _text_source(c) or c.data.format != "text"),
    Row("data.messages_column", "data.format=chat", lambda c: not _text_source(c) or c.data.format == "chat"),
    Row("data.prompt_column", "data.format=instruction", lambda c: not _text_source(c) or c.data.format == "instruction"),
    Row("data.completion_column", "data.format=instruction", lambda c: not _text_source(c) or c.data.format == "instruction"),
    Row(
        "data.text_column",
        "model.task=causal-lm, data.format=text from a json/jsonl/csv/parquet file, a folder of them or a Hub dataset",
        lambda c: (
            not _text_source(c)
            or (
                c.model.task == "causal-lm"
                and c.data.format == "text"
                and _tokens(c)
                and not c.data.path.endswith(".txt")
                and not _prepared(c)
            )
        ),
    ),
    Row("data.text_columns", "model.task=sequence-classification, token-classification, masked-lm or seq2seq", _task(*TEXT_TASKS)),
    Row("data.label_column", "model.task=sequence-classification, token-classification or seq2seq", _task(*TEXT_TASKS[:2], "seq2seq")),
    Row("data.mlm_probability", "model.task=masked-lm", _task("masked-lm")),
    Row("data.source_lang", TRANSLATIONS, lambda c: not _text_source(c) or (c.model.task == "seq2seq" and _translations(c))),
    Row("data.target_lang", TRANSLATIONS, lambda c: not _text_source(c) or (c.model.task == "seq2seq" and _translations(c))),
    Row(
        "data.val_fraction",
        "data without a validation split of its own (a folder's validation files or split, prepared or streamed data and "
        "data.path=random have one)",
        lambda c: not _text_source(c) or not _own_validation(c),
    ),
    Row(
        "data.tokenizer",
        "tokenized data (not data.path=random or synthetic, not model.task=image-classification; prepared data brings its own)",
        lambda c: not _text_source(c) or (_tokens(c) and not _prepared(c) and c.model.task != "image-classification"),
    ),
    Row("data.num_samples", "data.path=random or synthetic", lambda c: not _text_source(c) or not _tokens(c)),
    Row("data.synthetic_padding", "data.path=synthetic", lambda c: not _text_source(c) or c.data.path == "synthetic"),
    Row("data.verify", "a data.path folder written by scripts/prepare_data.py", lambda c: not _text_source(c) or _prepared(c)),
    Row(
        "model.vocab_size",
        "model.name=gpt, or data.path=synthetic (model.name=hf: the embedding is its config.json's)",
        lambda c: c.model.name not in ("hf", "mlp") or c.data.path == "synthetic",
    ),
    Row(
        "model.new_head",
        "model.hf_pretrained=true and model.task=sequence-classification, token-classification or image-classification",
        lambda c: getattr(c.model, "hf_pretrained", False) and c.model.task in LABELLED,
    ),
    Row("model.lora_alpha", "model.lora_rank > 0", _lora, refuse=FULL_FINE_TUNE),
    Row("model.lora_dropout", "model.lora_rank > 0", _lora, refuse=FULL_FINE_TUNE),
    Row("model.lora_targets", "model.lora_rank > 0", _lora, refuse=FULL_FINE_TUNE),
    Row("model.lora_experts", "model.lora_rank > 0", _lora, refuse=FULL_FINE_TUNE),
    Row("train.beta1", "train.optimizer=adamw", lambda c: c.train.optimizer == "adamw"),
    Row("train.beta2", "train.optimizer=adamw", lambda c: c.train.optimizer == "adamw"),
    Row("train.weight_decay", "train.optimizer=adamw", lambda c: c.train.optimizer == "adamw"),
    Row("train.weight_decay_params", "train.optimizer=adamw", lambda c: c.train.optimizer == "adamw"),
    Row("train.warmup_steps", DECAYING, lambda c: c.train.lr_schedule != "constant"),
    Row("train.min_lr", DECAYING, lambda c: c.train.lr_schedule != "constant"),
    Row("train.lr_decay_steps", DECAYING, lambda c: c.train.lr_schedule != "constant"),
    Row("train.lr_decay_fraction", "train.lr_schedule=wsd", lambda c: c.train.lr_schedule == "wsd"),
    Row(
        "model.selective_ac",
        "model.activation_checkpointing=selective",
        lambda c: getattr(c.model, "activation_checkpointing", "none") == "selective",
    ),
    Row("model.experts_per_token", "model.n_experts > 0 (model.name=gpt)", _experts),
    Row("model.rope_theta", "model.flavor=llama (model.name=gpt)", lambda c: getattr(c.model, "flavor", "llama") == "llama"),
    Row(
        "model.bias",
        "model.flavor=gpt2 (model.name=gpt; the llama flavor has no biases)",
        lambda c: getattr(c.model, "flavor", "gpt2") == "gpt2",
    ),
    Row("model.moe_aux_loss_coef", "model.n_experts > 0 (model.name=gpt), or a MoE model.name=hf", _experts),
    Row("parallel.microbatches", "parallel.pipeline_stages > 1", _pipeline),
    Row("parallel.schedule", "parallel.pipeline_stages > 1", _pipeline),
    Row("parallel.split", "parallel.pipeline_stages > 1", _pipeline),
    Row("parallel.timeline", "parallel.pipeline_stages > 1", _pipeline),
    Row(
        "parallel.stages_per_rank",
        "parallel.pipeline_stages > 1 with parallel.schedule=interleaved1f1b or interleavedzb",
        lambda c: _pipeline(c) and c.parallel.schedule in ("interleaved1f1b", "interleavedzb"),
    ),
)
# Not here: parallel.reduce_every_microstep (FSDP2 only), as an FSDP launch config may shard with parallel.dp_shard=1
# (parallel/mesh.py): the config alone does not know.
BY_KEY = {row.key: row for row in ROWS}


def _value(cfg: Any, key: str) -> tuple[bool, Any, Any]:
    """(whether this config has `key`, its value, its default in its section's class)."""
    section, parts = cfg, key.split(".")
    for part in parts[:-1]:
        section = getattr(section, fields_of(section)[part].name)
    fields = fields_of(section)
    if parts[-1] not in fields:
        return False, None, None
    name = fields[parts[-1]].name
    return True, getattr(section, name), getattr(type(section)(), name)


def is_read(cfg: Any, key: str) -> bool:
    """Whether a run of `cfg` reads `key` (keys no row names are read by every run)."""
    row = BY_KEY.get(key)
    return row is None or row.reads(cfg)


def unread(cfg: Any, keys: list[str]) -> list[str]:
    """The keys among `keys` (the ones the user set) that this run does not read, as notice items ("key (read only
    with ...)"); raises UserError for one the row refuses when set to a value other than its default."""
    items = []
    for key in dict.fromkeys(keys):
        row = BY_KEY.get(key)
        if row is None or row.reads(cfg):
            continue
        present, value, default = _value(cfg, key)
        if not present or value == default:  # another model's key (config/load.py lists it); a default changes nothing
            continue
        if row.refuse:
            raise UserError(f"{key}: {row.refuse}")
        items.append(f"{key} (read only with {row.when})")
    return items


def table_markdown() -> str:
    """The table as docs/configuration.md shows it."""
    lines = ["| key | read only with | set where it is not read |", "|---|---|---|"]
    lines += [f"| `{r.key}` | {r.when} | {'refused' if r.refuse else 'notice'} |" for r in ROWS]
    return "\n".join(lines)
