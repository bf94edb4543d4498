"""Prepare chat or instruction rows once (scripts/prepare_data.py --format chat|instruction): samples with their
masks in memory-mapped shards (data/prepared_samples.py), so that a large SFT set starts training in seconds.

    python scripts/prepare_data.py --format chat --input chats.jsonl --output data/chats --tokenizer MODEL_FOLDER

Each row is rendered by the tokenizer's chat template (or --chat_template FILE) exactly as training renders rows
read into memory (data/sft.py, data/chat_format.py): the same ids, the same mask of the assistant's tokens. Rows are
rendered in this process, one after the other. The last --val_fraction of the samples is the validation split.
The tokenizer and its chat template are saved beside the shards; training brings them into the run.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.config.sections import DataConfig
from parallel_train.data.packing import learnable_tokens
from parallel_train.data.prepared import FORMAT, SPLITS, VERSION, shard_name, token_dtype
from parallel_train.data.prepared_samples import SampleShardWriter
from parallel_train.data.sft import check_learnable, row_sources, sample_format
from parallel_train.data.tokenizers import load_tokenizer, needs_corpus
from parallel_train.errors import UserError


def data_config(opts: Any) -> DataConfig:
    """prepare_data.py's options as the data keys training reads the same rows with."""
    return DataConfig(
        path=opts.inputs[0],
        tokenizer=opts.tokenizer,
        format=opts.format,
        chat_template=opts.chat_template,
        messages_column=opts.messages_column,
        prompt_column=opts.prompt_column,
        completion_column=opts.completion_column,
    )


def render_all(d: DataConfig, inputs: list[str], fmt) -> list[tuple[np.ndarray, np.ndarray]]:
    samples = []
    for label, ds in row_sources(d, inputs, key="--input"):
        samples += [fmt.render(row, f"{label}: row {n}") for n, row in enumerate(ds, start=1)]
    if len(samples) < 2:
        raise UserError(f"--input {' '.join(inputs)}: {len(samples)} rows; a train and a validation sample need at least 2")
    return samples


def render(opts: Any) -> dict[str, Any]:
    """Every row rendered and checked, before anything in the output folder is touched."""
    d = data_config(opts)
    if needs_corpus(opts.tokenizer):
        raise UserError(
            f"--tokenizer {opts.tokenizer}: built from a corpus; give the model's folder, a Hub tokenizer, a tokenizer.json or byte"
        )
    tokenizer = load_tokenizer(opts.tokenizer)
    fmt = sample_format(d, tokenizer, opts.tokenizer)
    samples = render_all(d, opts.inputs, fmt)
    learnable = np.asarray([learnable_tokens(mask) for _, mask in samples], dtype=np.int64)  # nothing is cut here
    check_learnable(d, fmt, learnable, learnable, len(samples) - val_count(len(samples), opts.val_fraction), 0, opts.inputs)
    top = max(int(ids.max()) for ids, _ in samples if len(ids))
    if top >= tokenizer.size:
        raise UserError(
            f"--tokenizer {opts.tokenizer}: gives token id {top:,}, beyond its {tokenizer.size:,} ids; is its tokenizer.json complete?"
        )
    return {"samples": samples, "fmt": fmt, "tokenizer": tokenizer}


def val_count(samples: int, val_fraction: float) -> int:
    return max(1, int(samples * val_fraction))  # as data/sft.py splits rows read into memory


def write(out: Path, rendered: dict[str, Any], opts: Any) -> dict[str, Any]:
    """The last --val_fraction of the samples is the validation split; each split in shards of whole samples."""
    samples, tokenizer = rendered["samples"], rendered["tokenizer"]
    n_val = val_count(len(samples), opts.val_fraction)
    parts = {"train": samples[: len(samples) - n_val], "val": samples[len(samples) - n_val :]}
    dtype = token_dtype(tokenizer.size)
    splits = {s: write_split(out, s, parts[s], dtype, opts.shard_tokens) for s in SPLITS}
    return {**rendered, "dtype": dtype, "splits": splits}


def write_split(out: Path, split: str, samples: list, dtype: str, shard_tokens: int) -> dict[str, Any]:
    writer = SampleShardWriter(out, partial(shard_name, split), dtype, shard_tokens)
    for ids, mask in samples:
        writer.add(ids, mask)
    shards = writer.finish()
    learnable = sum(s["learnable"] for s in shards)
    return {"tokens": sum(s["tokens"] for s in shards), "chars": 0, "samples": len(samples), "learnable": learnable, "shards": shards}


def metadata(opts: Any, prepared: dict[str, Any], inputs_fingerprint: str, text_bytes: int) -> dict[str, Any]:
    """prepared.json of a samples folder: the text format's, plus what the samples are (`samples`)."""
    tokenizer, fmt = prepared["tokenizer"], prepared["fmt"]
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"spec": opts.tokenizer, "kind": tokenizer.kind, "vocab_size": tokenizer.size, "eot": tokenizer.eot,
                      "fingerprint": tokenizer.fingerprint, "files": sorted({**tokenizer.files(), **fmt.files()})},
        "dtype": prepared["dtype"],
        "splits": prepared["splits"],
        "samples": {"format": opts.format, "columns": list(fmt.columns), "rendered": fmt.describe()},
        "val_fraction": opts.val_fraction,
        "inputs": {"fingerprint": inputs_fingerprint, "given": opts.inputs, "bytes": text_bytes},
    }  # fmt: skip
