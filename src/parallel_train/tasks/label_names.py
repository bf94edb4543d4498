"""Class names of a task with labels (sequence and token classification), taken from its data.

The names are a `datasets` ClassLabel's when the data has one (a save_to_disk folder, parquet written by `datasets`:
the labels are then ids already), else the distinct labels of the train rows, sorted (numbers as numbers: 2 before
10). Label id i is names[i]. Every rank reads the same files, so every rank has the same names; the run saves them
(LABELS_FILE, in output_dir and every checkpoint: Data.files), and a resumed run whose data gives other names is
refused (run/resume_config.py), since its ids would mean other classes. A validation label that never occurs in
training is refused too: the model could never predict it; and so is training data of one class (or one tag).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError
from parallel_train.tasks.text_rows import Rows

LABELS_FILE = "label_names.json"


def class_label_names(feature: Any) -> list[str] | None:
    """A ClassLabel's names, also of a list of them (run_ner's ner_tags); None for plain values."""
    inner = getattr(feature, "feature", feature)  # datasets' List/Sequence of ClassLabel
    names = getattr(inner, "names", None)
    return list(names) if names is not None and type(inner).__name__ == "ClassLabel" else None


def as_label(value: Any, where: Callable[[], str]) -> Any:
    """A label value as a dict key: a whole number (1.0 read from a csv) as an int; text as it is."""
    if isinstance(value, bool) or isinstance(value, str | Integral):
        return value
    if isinstance(value, Real) and float(value).is_integer():
        return int(value)
    raise UserError(
        f"data.path: {where()} has the label {value!r}, which is not a class (text or a whole number); regression is not supported"
    )


def ordered(values: set[Any], column: str) -> list[Any]:
    """Numbers sorted as numbers, texts as texts; a mix is a one-line error naming the column (1 and '1' would be two
    classes)."""
    numbers = [v for v in values if not isinstance(v, str)]
    if numbers and len(numbers) < len(values):
        text = next(v for v in values if isinstance(v, str))
        raise UserError(
            f"data.path: the labels of {column!r} mix numbers ({numbers[0]!r}) and text ({text!r}); write every label the same way"
        )
    return sorted(values)


def head_names(cfg: Any) -> list[str] | None:
    """The class names of the pretrained head the run keeps, in its rows' order (the model's `head_label_names`: for
    model.name=hf, its folder's id2label when its weights hold a head with names: models/hf_head.py), or None."""
    own = getattr(cfg.model, "head_label_names", None)  # a model's config may say (models/hf.py HFConfig)
    return own() if own is not None else None


def with_head(names: list[str], head: list[str] | None) -> list[str]:
    """The run's class names: a pretrained head's first, in its rows' order (each row stays the row of its name), then
    the data's names it lacks (new rows); the data's alone when there is no head, or it shares no name with it (the
    model refuses that head, or starts a new one: model.new_head)."""
    if not head or not set(names) & set(head):
        return names
    return [*head, *(name for name in names if name not in head)]


def label_ids(rows: Rows, nested: bool, head: list[str] | None = None) -> tuple[list[str], list[Any], list[Any]]:
    """(the class names, the train labels as ids, the validation labels as ids). `nested`: each row holds a list of
    labels (one per word); else one label. `head`: a pretrained head's class names (head_names), which come first."""
    feature_names = class_label_names(rows.features[rows.label])
    splits = {"train": rows.train[rows.label], "validation": rows.val[rows.label]}
    flat = {s: [(i, v) for i, row in enumerate(vs) for v in (row if nested else [row])] for s, vs in splits.items()}
    if feature_names is not None:
        data_names, named = feature_names, dict(enumerate(feature_names))  # ids already: id i is feature_names[i]
    else:
        classes = ordered({as_label(v, lambda: rows.where("train", i)) for i, v in flat["train"]}, rows.label)  # noqa: B023
        data_names, named = [str(v) for v in classes], {v: str(v) for v in classes}
    names = with_head(data_names, head)
    at = {name: i for i, name in enumerate(names)}
    lookup = {key: at[name] for key, name in named.items()}
    ids = {}
    for split, pairs in flat.items():
        mapped = []
        for i, v in pairs:
            key = as_label(v, lambda: rows.where(split, i))  # noqa: B023 (called at once)
            if key not in lookup:
                raise UserError(unknown(rows, split, i, v, data_names, feature_names is not None))
            mapped.append(lookup[key])
        ids[split] = regroup(mapped, splits[split]) if nested else mapped
        if split == "train":
            check_classes(rows.label, names, mapped, nested)
    return names, ids["train"], ids["validation"]


def check_classes(column: str, names: list[str], train_ids: list[int], nested: bool) -> None:
    """Training that sees one class only learns to say it (loss 0, accuracy 1): one line naming the class and the
    column, as an imagefolder of one class folder is (tasks/image_folder.py)."""
    seen = set(train_ids)
    if len(seen) == 1:
        what, kind, one, model = ("word", "tag", "tag", "tagger") if nested else ("row", "label", "class", "classifier")
        raise UserError(
            f"data.path: every train {what} has the {kind} {names[seen.pop()]!r} in the column {column!r}: one {one}, nothing "
            f"to learn; a {model} needs two or more (add rows of another {one}, or name the right column with data.label_column)"
        )


def unknown(rows: Rows, split: str, i: int, value: Any, names: list[str], from_feature: bool) -> str:
    where = rows.where(split, i)
    if from_feature:
        return f"data.path: {where} has the label id {value!r}, not one of its ClassLabel's {len(names)} classes (0..{len(names) - 1}); fix or remove the row"
    return (
        f"data.path: {where} has the label {value!r}, which no train row has (train labels: {', '.join(names[:8])}"
        f"{', ...' if len(names) > 8 else ''}); the model could never predict it: add train rows of it, or remove the row"
    )


def regroup(flat: list[int], like: list[list[Any]]) -> list[list[int]]:
    """`flat` cut into rows as long as those of `like`."""
    ends = np.cumsum([len(row) for row in like])
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def names_file(names: list[str] | None) -> dict[str, str]:
    """The file the run saves its class names in (Data.files), beside its tokenizer in output_dir and every
    checkpoint, so that an export of any checkpoint (scripts/export.py) writes the run's id2label; {} without names."""
    return {LABELS_FILE: json_text(names) + "\n"} if names else {}


def saved_label_names(folder: Path) -> list[str] | None:
    """The class names saved with a run or a checkpoint (names_file), or None."""
    path = Path(folder) / LABELS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def changed_labels(saved_text: str, names: list[str]) -> str | None:
    """What differs between a resumed run's saved names and this data's, or None."""
    saved = json.loads(saved_text)
    if saved == names:
        return None
    at = next((i for i, (a, b) in enumerate(zip(saved, names, strict=False)) if a != b), min(len(saved), len(names)))
    was = repr(saved[at]) if at < len(saved) else "none"
    now = repr(names[at]) if at < len(names) else "none"
    return f"{len(saved)} classes before, {len(names)} now; label id {at} was {was}, is {now}"
