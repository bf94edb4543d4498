"""Image classification (an imagefolder: one folder of images per class; tasks/image_folder.py reads it)."""

from __future__ import annotations

from parallel_train.core.task import Task
from parallel_train.tasks.image_folder import load_images

TASK = Task(
    "image-classification",
    "AutoModelForImageClassification",
    "pixel_values",
    "samples",
    has_labels=True,
    load=load_images,
    metrics=("loss", "accuracy", "f1"),
)
