"""A causal language model: predict each next token. Its data comes from data.source (text windows, chat rows,
prepared shards, streams: data/sources.py), as (inputs, shifted targets) tuples; a dict batch of your own carries
`labels` equal to its input ids, shifted once by core/task.py's `align`, as transformers' causal-LM loss does."""

from __future__ import annotations

from parallel_train.core.task import Task

TASK = Task("causal-lm", "AutoModelForCausalLM", "input_ids", "tokens", labels_are_inputs=True, metrics=("loss", "perplexity", "accuracy"))
