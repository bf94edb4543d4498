"""Sequence to sequence (run_translation's and run_summarization's layouts): write the target from the source."""

from __future__ import annotations

from parallel_train.tasks.task import Task

TASK = Task("seq2seq", "AutoModelForSeq2SeqLM", "input_ids", "tokens", metrics=("loss", "perplexity", "accuracy"))
