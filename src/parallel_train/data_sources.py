"""Data registry: `data.source` -> a loader `(Config, saved vocab or None) -> Data`.

`text` (the default) is data.py's `build_datasets`: data.path names a .txt/.json/.jsonl/.csv/.parquet
file, a Hub dataset (or a folder laid out like one), 'random' or 'synthetic'. Two kinds of `text` data
take their own path: a folder written by scripts/prepare_data.py (prepared_data.py: memory-mapped token
shards) and, with data.streaming=true, a stream (streaming_data.py).

To train on data of your own: write a loader in its own module (e.g. `parallel_train/dialogue_data.py`)
that returns a `Data` (train and validation datasets whose batches are (inputs, targets), the
vocabulary, the vocabulary size or number of classes, and optionally a collate function), import it
here and add one line to DATA_SOURCES. docs/guide.md walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parallel_train.config import Config
from parallel_train.config_fields import check
from parallel_train.data import Data, build_datasets
from parallel_train.prepared_data import any_rank, is_prepared, load_prepared
from parallel_train.streaming_data import load_stream

DATA_SOURCES: dict[str, Callable[[Config, Any], Data]] = {
    "text": build_datasets,
}


def check_source(cfg: Config) -> None:
    check(
        cfg.data.source in DATA_SOURCES, f"data.source: unknown data source {cfg.data.source!r}; known: {', '.join(sorted(DATA_SOURCES))}"
    )


def load_data(cfg: Config, vocab: Any = None) -> Data:
    """The data of `data.source` (pass the saved vocab when resuming, so token ids stay the same)."""
    check_source(cfg)
    if cfg.data.source == "text" and cfg.data.streaming:
        return load_stream(cfg, vocab)
    # Every rank takes the prepared path if any does: a node whose copy is missing then says so (a collective).
    if cfg.data.source == "text" and any_rank(is_prepared(cfg.data.path)):
        return load_prepared(cfg, vocab)
    return DATA_SOURCES[cfg.data.source](cfg, vocab)
