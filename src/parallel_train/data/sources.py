"""Data registry: `data.source` -> a loader `(Config, saved vocab or None) -> Data`.

`text` (the default) is data/text.py's `build_datasets`: data.path names a .txt/.json/.jsonl/.csv/.parquet
file, a Hub dataset (or a folder laid out like one), 'random' or 'synthetic'. Three kinds of `text` data
take their own path: a folder written by scripts/prepare_data.py (data/prepared.py: memory-mapped token
shards), with data.streaming=true a stream (data/streaming.py), and with data.format=chat|instruction rows of
conversations that learn only the answers (data/sft.py).

To train on data of your own: write a loader in its own module (e.g. `parallel_train/dialogue_data.py`)
that returns a `Data` (train and validation datasets whose batches are (inputs, targets), the
vocabulary, the vocabulary size or number of classes, and optionally a collate function), import it
here and add one line to DATA_SOURCES. docs/guide.md walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parallel_train.config.sections import Config
from parallel_train.core.fields import check
from parallel_train.core.task import DEFAULT
from parallel_train.data.prepared import any_rank, is_prepared, load_prepared
from parallel_train.data.sft import load_samples
from parallel_train.data.streaming import load_stream
from parallel_train.data.text import Data, build_datasets
from parallel_train.data.tokenizers import check_spec

DATA_SOURCES: dict[str, Callable[[Config, Any], Data]] = {
    "text": build_datasets,
}


def check_source(cfg: Config) -> None:
    """What can be checked before anything is loaded: the tokenizer spec, the source exists, and the built-in one gives
    what the model takes."""
    check_spec(cfg.data.tokenizer)
    check(
        cfg.data.source in DATA_SOURCES, f"data.source: unknown data source {cfg.data.source!r}; known: {', '.join(sorted(DATA_SOURCES))}"
    )
    if cfg.data.source == "text" and cfg.model.task == DEFAULT:  # the other tasks read their own data (tasks/)
        check_inputs(cfg, "feature vectors" if cfg.data.path == "random" else "token ids")


def check_inputs(cfg: Config, inputs: str) -> None:
    """The model takes what the data gives (its `inputs` against Data.inputs): the seed MLP's Linear layers on token ids
    would fail in the first step on a dtype mismatch."""
    takes = cfg.model.inputs
    check(
        takes == inputs,
        f"model.name={cfg.model.name} takes {takes}, but data.path={cfg.data.path} (data.source={cfg.data.source}) gives {inputs}; "
        f"choose a model that takes {inputs} or data that gives {takes}",
    )


def load_data(cfg: Config, vocab: Any = None) -> Data:
    """The data of `data.source` (pass the saved vocab when resuming, so token ids stay the same)."""
    check_source(cfg)
    if cfg.data.source == "text" and cfg.data.streaming:
        data = load_stream(cfg, vocab)
    # Every rank takes the prepared path if any does: a node whose copy is missing then says so (a collective).
    elif cfg.data.source == "text" and any_rank(is_prepared(cfg.data.path)):
        data = load_prepared(cfg, vocab)
    elif cfg.data.source == "text" and cfg.data.format != "text":  # chat or instruction rows (data/sft.py)
        data = load_samples(cfg, vocab)
    else:
        data = DATA_SOURCES[cfg.data.source](cfg, vocab)
    check_inputs(cfg, data.inputs)  # a source of your own says what it gives
    return data
