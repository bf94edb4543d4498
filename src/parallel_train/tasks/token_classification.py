"""Token classification (run_ner's layout): one label per word, on its first sub-word, -100 on the others.

Rows: `tokens` (a list of words) and `ner_tags` (a list of labels, one per word: a ClassLabel's ids, or the labels
themselves); other names with data.text_columns=[words] and data.label_column=tags. The words are encoded as
words (the tokenizer's is_pretokenized), so each token knows its word; the word's label goes on its first token,
and its other tokens, the special tokens and the padding are -100, as run_ner does by default. Words cut off by
model.block_size are not learned.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parallel_train.core.task import Task
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.tasks.label_names import head_names, label_ids, names_file
from parallel_train.tasks.text_rows import EncodedRows, Encoder, Rows, check_text_columns, read_rows, task_data, task_tokenizer

NAME = "token-classification"
LAYOUTS = ((("tokens",), "ner_tags"),)


def first_subword_labels(encodings: list[Any], tags: list[list[int]]) -> np.ndarray:
    """(N, T) labels: each word's tag on its first token, -100 everywhere else."""
    labels = np.full((len(encodings), len(encodings[0].ids) if encodings else 0), IGNORE_INDEX, dtype=np.int32)
    for r, (encoding, row) in enumerate(zip(encodings, tags, strict=True)):
        previous = None
        for t, word in enumerate(encoding.word_ids):
            if word is not None and word != previous:
                labels[r, t] = row[word]
            previous = word
    return labels


def words_of(rows: Rows, split: str, part: dict[str, list]) -> list[list[str]]:
    """Each row's words, as many as its labels: one line naming the row where they differ."""
    words, tags = part[rows.texts[0]], part[rows.label]
    for i, (w, t) in enumerate(zip(words, tags, strict=True)):
        if not isinstance(w, list) or not isinstance(t, list) or len(w) != len(t):
            count = lambda v: f"{len(v)}" if isinstance(v, list) else f"not a list ({type(v).__name__})"  # noqa: E731
            raise UserError(
                f"data.path: {rows.where(split, i)} has {count(w)} words ({rows.texts[0]!r}) and {count(t)} labels "
                f"({rows.label!r}); give one label per word"
            )
    return [[str(x) for x in w] for w in words]


def load(cfg: Any, saved: Any) -> Any:
    """Data of dict batches: input_ids, attention_mask, labels (B, T)."""
    check_text_columns(cfg.data, NAME, (1,))
    rows = read_rows(cfg, LAYOUTS, NAME)
    tokenizer = task_tokenizer(cfg, saved, NAME)
    train_words, val_words = words_of(rows, "train", rows.train), words_of(rows, "validation", rows.val)
    names, train_tags, val_tags = label_ids(rows, nested=True, head=head_names(cfg))
    encoder = Encoder.of(tokenizer, cfg.model.block_size)

    def encoded(words: list[list[str]], tags: list[list[int]]) -> EncodedRows:
        encodings = encoder.encode(words, pretokenized=True)
        return EncodedRows({**encoder.arrays(encodings), "labels": first_subword_labels(encodings, tags)})

    train, val = encoded(train_words, train_tags), encoded(val_words, val_tags)
    return task_data(cfg, tokenizer, rows, train, val, files=names_file(names), label_names=names)


TASK = Task(
    NAME, "AutoModelForTokenClassification", "input_ids", "tokens", has_labels=True, load=load, metrics=("loss", "accuracy", "entity_f1")
)
