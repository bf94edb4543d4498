"""Image classification (an imagefolder: one folder of images per class)."""

from __future__ import annotations

from parallel_train.tasks.task import Task

TASK = Task(
    "image-classification",
    "AutoModelForImageClassification",
    "pixel_values",
    "samples",
    has_labels=True,
    metrics=("loss", "accuracy", "f1"),
)
