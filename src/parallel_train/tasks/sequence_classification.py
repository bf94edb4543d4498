"""Sequence classification (run_glue's layout): one label per sentence or sentence pair."""

from __future__ import annotations

from parallel_train.tasks.task import Task

TASK = Task(
    "sequence-classification",
    "AutoModelForSequenceClassification",
    "input_ids",
    "samples",
    has_labels=True,
    metrics=("loss", "accuracy", "f1"),
)
