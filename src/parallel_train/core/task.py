"""What a model is trained to do (`model.task`): the Task every task module defines (tasks/registry.py lists them).

A task says what a batch's labels mean and how the run is judged; everything else (the engines, the optimizer
step, checkpoints) is the same for every task, because every task's loss is the same thing: cross-entropy of the
model's logits against labels aligned with them, summed over the labels that count (not IGNORE_INDEX, -100) and
divided by their number over the whole optimizer step (step.py). So a sentence label weighs one sample, a tagged
word one word, a target token one token, and the loss is the same on 1 process, on 8, with accumulation or not.

    task                     logits          labels            a transformers model       judged by (val_*)
    causal-lm                (B, T, vocab)   (B, T) next ids   AutoModelForCausalLM       loss, perplexity
    sequence-classification  (B, classes)    (B,) class ids    ...ForSequenceClassification  accuracy, f1
    token-classification     (B, T, classes) (B, T) tag ids    ...ForTokenClassification  accuracy, entity p/r/f1
    masked-lm                (B, T, vocab)   (B, T) masked ids ...ForMaskedLM             loss, perplexity
    seq2seq                  (B, T, vocab)   (B, T) target ids ...ForSeq2SeqLM            loss, perplexity
    image-classification     (B, classes)    (B,) class ids    ...ForImageClassification  accuracy, f1

Labels in a batch are aligned with the logits (position t's label is what position t should predict), with one
exception taken from transformers: a causal LM's dict batch carries `labels` equal to its input ids, and the
model learns to predict the next one. `align` shifts those labels once, before the engines see the batch, so the
loss, the count and every metric see aligned labels; the template's own text windows are (inputs, targets)
tuples whose targets are shifted already.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from parallel_train.losses import IGNORE_INDEX, loss_sum, valid_on_host

DEFAULT = "causal-lm"
# The transformers Auto class of each task, for the models (floor 1, below tasks/registry.py): each task module's
# `auto_class`, which tests/test_structure.py checks against this table.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}
# Every task model.task may name (core/model_config.py lists them as its choices); tasks/registry.py holds the Task of each.
TASK_NAMES = tuple(AUTO_CLASSES)
# The tasks with class names (Task.has_labels, which tests/test_structure.py checks against this): a classifier's head.
LABELLED = ("sequence-classification", "token-classification", "image-classification")


@dataclass(frozen=True)
class Task:
    """What one task is. Each task is one module of this package (tasks/sequence_classification.py, ...) defining
    `TASK = Task(...)`; tasks/registry.py lists them. Everything here is a value or a function: the engines, the
    optimizer step and the Trainer read a task only through these fields."""

    name: str
    auto_class: str  # the transformers Auto class that builds (and reloads) a model of this task
    main_input: str  # the batch key a model's forward takes first: token ids or pixels
    units: str  # what throughput counts: "tokens" (non-padding) or "samples"
    labels_are_inputs: bool = False  # transformers' causal-LM convention: labels = input ids, shifted by `align`
    has_labels: bool = False  # class names (id2label) come from the data and go into the exported config
    # (Config, the resumed run's tokenizer or None) -> Data whose batches are dicts: the task's columns read from
    # data.path and collated. None: the data.source loaders (data/sources.py) give the data, as for a causal LM.
    load: Callable[[Any, Any], Any] | None = None
    # (logits, labels) -> the summed loss of the labels that count (step.py divides by their number over the step).
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_sum
    # What validation reports (val_<name>), "loss" first: names of eval_metrics.TASK_METRICS, or "entity_f1" (from
    # the data's BIO tag names; entity precision and recall come with it).
    metrics: tuple[str, ...] = ("loss", "accuracy")


def align(task: Task, batch):
    """The batch with labels aligned to the logits. Only a causal LM's dict batch changes: label t becomes label t+1
    (the last position learns nothing), exactly the shift transformers' causal-LM loss makes."""
    if not task.labels_are_inputs or not isinstance(batch, Mapping) or "labels" not in batch:
        return batch
    labels = batch["labels"]
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    return {**batch, "labels": shifted}


def units_in(task: Task, batch) -> int:
    """What throughput counts in a batch, on the host from the CPU batch (no device read: step.py): its samples for a
    task judged per sample (units "samples"), else its tokens that are not padding: the attention mask's sum where the
    batch has one, else the labels that count (a tuple's targets). A label column is never counted as tokens."""
    labels = batch["labels"] if isinstance(batch, Mapping) else batch[1]  # data/batch.py's targets (a floor above)
    if task.units == "samples":
        return len(labels)
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is not None:
        return int(mask.numpy().sum()) if mask.device.type == "cpu" else int(mask.sum())
    return valid_on_host(labels)


class Aligned:
    """`batches` (a loader, iterated again at every evaluation) with each batch aligned for `task`."""

    def __init__(self, task: Task, batches):
        self.task, self.batches = task, batches

    def __iter__(self):
        return (align(self.task, batch) for batch in self.batches)

    def __len__(self) -> int:
        return len(self.batches)
