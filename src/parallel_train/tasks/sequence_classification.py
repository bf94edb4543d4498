"""Sequence classification (run_glue's layout): one label per sentence or sentence pair.

Rows: `sentence1`, `sentence2`, `label` (a pair, e.g. GLUE MRPC), or `sentence`, `label` (e.g. SST-2), or `text`,
`label`; other names with data.text_columns=[a,b] and data.label_column=c. A pair is encoded by the tokenizer's own
post-processor ([CLS] a [SEP] b [SEP] for a BERT, with token_type_ids when it gives them), truncated to
model.block_size (the longer text first, as transformers does) and padded to it. Labels are class ids
(tasks/label_names.py), one per sample, none -100.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parallel_train.core.task import Task
from parallel_train.tasks.label_names import head_names, label_ids, names_file
from parallel_train.tasks.text_rows import EncodedRows, Encoder, check_text_columns, column_texts, read_rows, task_data, task_tokenizer

NAME = "sequence-classification"
LAYOUTS = ((("sentence1", "sentence2"), "label"), (("sentence",), "label"), (("text",), "label"))


def load(cfg: Any, saved: Any) -> Any:
    """Data of dict batches: input_ids, attention_mask[, token_type_ids], labels (B,)."""
    check_text_columns(cfg.data, NAME, (1, 2))
    rows = read_rows(cfg, LAYOUTS, NAME)
    tokenizer = task_tokenizer(cfg, saved, NAME)
    names, train_labels, val_labels = label_ids(rows, nested=False, head=head_names(cfg))
    encoder = Encoder.of(tokenizer, cfg.model.block_size)

    def encoded(part: dict[str, list], labels: list[int], split: str) -> EncodedRows:
        texts = [column_texts(rows, part, c, split) for c in rows.texts]
        inputs = list(zip(*texts, strict=True)) if len(texts) == 2 else texts[0]
        arrays = encoder.arrays(encoder.encode(inputs), pairs=len(texts) == 2)
        return EncodedRows({**arrays, "labels": np.asarray(labels, dtype=np.int32)})

    train, val = encoded(rows.train, train_labels, "train"), encoded(rows.val, val_labels, "validation")
    return task_data(cfg, tokenizer, rows, train, val, files=names_file(names), label_names=names, all_targets_count=True)


TASK = Task(
    NAME, "AutoModelForSequenceClassification", "input_ids", "samples", has_labels=True, load=load, metrics=("loss", "accuracy", "f1")
)
