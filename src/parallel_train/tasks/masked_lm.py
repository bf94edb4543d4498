"""Masked language modelling (run_mlm's layout): predict the masked tokens of each text."""

from __future__ import annotations

from parallel_train.tasks.task import Task

TASK = Task("masked-lm", "AutoModelForMaskedLM", "input_ids", "tokens", metrics=("loss", "perplexity", "accuracy"))
