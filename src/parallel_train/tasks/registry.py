"""Every task by name (model.task): one module each, listed once here. To add a task: a module of this package
defining `TASK = Task(...)` (tasks/task.py says what each field means), its name in tasks/task.py's TASK_NAMES, and
one line below."""

from __future__ import annotations

from parallel_train.tasks import (
    causal_lm,
    image_classification,
    masked_lm,
    seq2seq,
    sequence_classification,
    token_classification,
)
from parallel_train.tasks.task import Task

TASKS: dict[str, Task] = {
    m.TASK.name: m.TASK for m in (causal_lm, sequence_classification, token_classification, masked_lm, seq2seq, image_classification)
}


def task_of(cfg) -> Task:
    """The run's task (model.task)."""
    return TASKS[cfg.model.task]
