"""Data registry: `data.source` -> a loader `(Config, saved vocab or None) -> Data`.

`text` (the default) is data.py's `build_datasets`: data.path names a .txt/.json/.jsonl/.csv/.parquet
file, a Hub dataset (or a folder laid out like one), 'random' or 'synthetic'.

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
    return DATA_SOURCES[cfg.data.source](cfg, vocab)
