"""Token classification (run_ner's layout): one label per word, on its first sub-word, -100 on the others."""

from __future__ import annotations

from parallel_train.tasks.task import Task

TASK = Task(
    "token-classification",
    "AutoModelForTokenClassification",
    "input_ids",
    "tokens",
    has_labels=True,
    metrics=("loss", "accuracy", "entity_f1"),
)
