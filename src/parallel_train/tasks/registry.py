"""Every task by name (model.task): one module each, listed once here. To add a task: a module of this package
defining `TASK = Task(...)` (core/task.py says what each field means), its name in core/task.py's TASK_NAMES, and
one line below."""

from __future__ import annotations

from parallel_train.core.task import Task
from parallel_train.data.sources import load_data
from parallel_train.data.text import Data
from parallel_train.tasks import (
    causal_lm,
    image_classification,
    masked_lm,
    seq2seq,
    sequence_classification,
    token_classification,
)
from parallel_train.tasks.label_names import names_file

TASKS: dict[str, Task] = {
    m.TASK.name: m.TASK for m in (causal_lm, sequence_classification, token_classification, masked_lm, seq2seq, image_classification)
}


def task_of(cfg) -> Task:
    """The run's task (model.task)."""
    return TASKS[cfg.model.task]


def load_task_data(cfg, task: Task, saved) -> Data:
    """The run's data: the task reads its own columns from data.path (tasks/), unless a data.source of your own gives
    the batches (data/sources.py). A task with labels keeps their names with the run (label_names.json in output_dir
    and every checkpoint, checked on resume). `saved`: the resumed run's tokenizer, so token ids cannot shift."""
    own = task.load is not None and cfg.data.source == "text"
    data = task.load(cfg, saved) if own else load_data(cfg, saved)
    data.files = {**data.files, **names_file(data.label_names if task.has_labels else None)}
    return data
