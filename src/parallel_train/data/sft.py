"""Chat and instruction data (data.format=chat|instruction): rows in, samples that learn only the answers out.

    python train.py model.name=hf model.hf_path=FOLDER data.format=chat data.path=chats.jsonl [data.packing=true]

data.path is a json/jsonl/csv/parquet file, a folder of them (laid out like a Hub dataset), or a Hub dataset name,
as for text (data/inputs.py). Each row is one sample: its conversation rendered by the tokenizer's chat template
with the mask of the assistant's tokens (data/chat_format.py), so the loss counts only what the model should learn to
write. A sample longer than model.block_size + 1 tokens is a one-line error naming its row, or, with
data.truncate=true, cut to that length. The last data.val_fraction of the rows is the validation set.

Every row is tokenized at start, which suits some tens of MB of rows; `scripts/prepare_data.py --format chat`
writes the same samples into memory-mapped shards once (data/prepared.py), and training on that folder starts
in seconds whatever its size. Batches: data/packing.py (padded to the batch's longest, or packed with data.packing).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parallel_train.config.sections import Config, DataConfig
from parallel_train.data.chat_format import ChatFormat, load_format
from parallel_train.data.inputs import row_datasets
from parallel_train.data.packing import ALIGN, PackedSamples, PaddedSamples, Samples, SamplesInMemory, learnable_tokens
from parallel_train.data.text import Data, check_resumed_tokenizer, vocab_size_for
from parallel_train.data.tokenizers import Tokenizer, load_tokenizer, needs_corpus
from parallel_train.errors import UserError


def columns_of(d: DataConfig) -> tuple[str, ...]:
    return (d.messages_column,) if d.format == "chat" else (d.prompt_column, d.completion_column)


def sample_format(d: DataConfig, tokenizer: Tokenizer, spec: str) -> ChatFormat:
    """How rows of data.format become samples, with the run's tokenizer (`spec` names it: its chat template)."""
    core = getattr(tokenizer, "tokenizer", None)  # a Hugging Face tokenizer's `tokenizers` core
    if core is None and (d.format == "chat" or d.chat_template):
        raise UserError(
            f"data.format={d.format}: a chat template needs a Hugging Face tokenizer, not data.tokenizer={spec}; give the "
            "model's folder (model.name=hf does so itself), a Hub tokenizer or a tokenizer.json (with data.chat_template=FILE)"
        )
    return load_format(d.format, spec, core, tokenizer, d.chat_template, columns_of(d))


def row_sources(d: DataConfig, inputs: list[str] | None = None, key: str = "data.path") -> list[tuple[str, Any]]:
    """(label, datasets.Dataset) for each file of data.path (or `inputs`, named by `key` in messages; a Hub dataset
    is one), rows in file order."""
    out = []
    for label, ds in row_datasets(inputs or [d.path], key, text_refusal=f"data.format={d.format}"):
        missing = [c for c in columns_of(d) if c not in ds.column_names]
        if missing:
            column_key = (
                "data.messages_column"
                if d.format == "chat"
                else f"data.{'prompt' if missing[0] == d.prompt_column else 'completion'}_column"
            )
            raise UserError(f"{column_key}: {missing[0]!r} is not a column of {label!r}; columns: {', '.join(ds.column_names)}")
        out.append((label, ds.select_columns(list(columns_of(d)))))
    return out


def fit(ids: np.ndarray, mask: np.ndarray, block_size: int, truncate: bool, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A sample that fits model.block_size (block_size + 1 ids: inputs and targets), cut with data.truncate."""
    if len(ids) <= block_size + 1:
        return ids, mask
    if not truncate:
        raise UserError(
            f"data.path: {where} is {len(ids):,} tokens, longer than model.block_size + 1 = {block_size + 1:,}; raise "
            "model.block_size, or cut such samples with data.truncate=true"
        )
    return ids[: block_size + 1], mask[: block_size + 1]


def render_rows(cfg: Config, fmt: ChatFormat) -> tuple[SamplesInMemory, np.ndarray]:
    """Every row as a sample, and each sample's tokens to learn before data.truncate cut it (the cause, when none is left)."""
    ids, masks, uncut = [], [], []
    for label, ds in row_sources(cfg.data):
        for number, row in enumerate(ds, start=1):
            where = f"{label}: row {number}"
            rendered = fmt.render(row, where)
            uncut.append(learnable_tokens(rendered[1]))
            sample_ids, mask = fit(*rendered, cfg.model.block_size, cfg.data.truncate, where)
            ids.append(sample_ids.astype(np.int32))
            masks.append(mask)
    if len(ids) < 2:
        raise UserError(f"data.path: {cfg.data.path!r} holds {len(ids)} rows; a train and a validation sample need at least 2")
    return SamplesInMemory(ids, masks), np.asarray(uncut, dtype=np.int64)


def check_learnable(
    d: DataConfig, fmt: ChatFormat, learnable: np.ndarray, uncut: np.ndarray, n_train: int, block_size: int, inputs: list[str] | None = None
) -> None:
    """Nothing to learn is an error, at start: a split whose samples have no target the loss counts would train with
    loss 0 (no gradient, yet the optimizer's weight decay and momentum would move the weights) or report a
    validation loss of 0/0. `learnable`, `uncut`: each sample's tokens to learn after and before data.truncate.
    `inputs`: prepare_data's --input files (data.path otherwise)."""
    key = "--input" if inputs else "data.path"
    for split, part in (("train", slice(0, n_train)), ("validation", slice(n_train, len(learnable)))):
        if learnable[part].sum():
            continue
        cut = bool(uncut[part].sum())
        why = truncated_away(block_size) if cut else no_answers(d, fmt, range(len(learnable))[part], inputs, key)
        source = f"--input {' '.join(inputs)}" if inputs else f"data.path: {d.path!r}"
        raise UserError(f"{source} has nothing to learn in its {split} split ({len(learnable[part]):,} samples): {why}")


def truncated_away(block_size: int) -> str:
    return (
        f"data.truncate=true cut every answer away (a sample keeps its first model.block_size + 1 = {block_size + 1:,} tokens, "
        "which end before its answers); raise model.block_size"
    )


def no_answers(d: DataConfig, fmt: ChatFormat, wanted: range, inputs: list[str] | None, key: str) -> str:
    """Why rows hold no token to learn (read again: this is the error's path only)."""
    answers, index = [], 0
    for label, ds in row_sources(d, inputs, key=key):
        for number, row in enumerate(ds, start=1):
            if index in wanted:
                answers += [m["content"] for m in fmt.messages(row, f"{label}: row {number}") if m["role"] == "assistant"]
            index += 1
    if not answers:
        return "no row has an assistant turn (a message with role 'assistant'), and the loss counts only the assistant's tokens; add the answers"
    if not any(str(a).strip() for a in answers):
        return f"every answer is empty ({len(answers):,} assistant turns with no text), and the loss counts only the answers' tokens; fill them in"
    return (
        "the chat template marks none of the assistant's tokens; check its {% generation %}...{% endgeneration %} tags "
        "(or give data.chat_template=FILE)"
    )


def sample_datasets(cfg: Config, train: Samples, val: Samples, pad_id: int) -> tuple[Any, Any]:
    """The train and validation datasets of samples: packed (data.packing) or padded per batch (data/packing.py)."""
    if cfg.data.packing:
        return PackedSamples(train, cfg.model.block_size, pad_id), PackedSamples(val, cfg.model.block_size, pad_id)
    # torch's pipeline schedules and torch.compile want one shape for every batch
    fixed = cfg.parallel.pipeline_stages > 1 or cfg.train.compile
    # sequence parallel cuts every row into tp equal shards, context parallel into cp
    align = math.lcm(ALIGN, cfg.parallel.tp, cfg.parallel.cp)
    return tuple(PaddedSamples(samples, cfg.model.block_size, pad_id, fixed, align) for samples in (train, val))


def describe(cfg: Config, fmt_line: str, n_train: int, n_val: int, train: Any) -> str:
    how = f"packed into {len(train):,} rows of {cfg.model.block_size} ({100 * train.padding_share():.1f}% padding)" if cfg.data.packing else (
        "one per row, padded to each batch's longest")  # fmt: skip
    learn = f" ({int(train.samples.learnable.sum()):,} train tokens to learn)"
    return f"{cfg.data.path}: {n_train:,} train + {n_val:,} val samples{learn}, {fmt_line}; {how}"


def load_samples(cfg: Config, saved: Tokenizer | None = None) -> Data:
    """The Data of data.format=chat|instruction read from data.path (in memory). `saved`: a resumed run's tokenizer."""
    d = cfg.data
    if saved is None and needs_corpus(d.tokenizer):
        raise UserError(
            f"data.format={d.format}: data.tokenizer={d.tokenizer} is built from a corpus; give a tokenizer that exists on its own "
            "(the model's folder, a Hub tokenizer, a tokenizer.json, or byte)"
        )
    tokenizer = load_tokenizer(d.tokenizer) if saved is None else saved
    if saved is not None:
        check_resumed_tokenizer(saved, d.tokenizer)
    fmt = sample_format(d, tokenizer, d.tokenizer)
    samples, uncut = render_rows(cfg, fmt)
    n_val = max(1, int(len(samples) * d.val_fraction))
    n = len(samples) - n_val
    check_learnable(d, fmt, samples.learnable, uncut, n, cfg.model.block_size)
    train = SamplesInMemory(samples.ids[:n], samples.masks[:n])
    val = SamplesInMemory(samples.ids[n:], samples.masks[n:])
    pad_id = tokenizer.eot if tokenizer.eot is not None else 0
    train_set, val_set = sample_datasets(cfg, train, val, pad_id)
    return Data(
        train_set,
        val_set,
        tokenizer,
        vocab_size_for(tokenizer, cfg),
        description=describe(cfg, fmt.describe(), n, n_val, train_set),
        files=fmt.files(),
    )
