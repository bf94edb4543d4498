"""A pretrained classifier's head and the run's class names: which rows keep their weights, which grow, which start anew.

A classifier or tagger folder (a ...ForSequenceClassification, ...ForTokenClassification, ...ForImageClassification
saved with its head) names its head's rows in its config.json's id2label. Fine-tuned on data with those names, row
i must stay the row of name i: the data's class ids follow the head (tasks/label_names.py puts the head's names
first, in its rows' order, and the data's other names after them), so nothing of the head moves. Then:

- the data's names are the head's, or some of them: every row keeps its weights and its name (rows of names the
  data lacks stay as they are, and are exported with them);
- the data has names the head lacks: the head grows by one row per new name, the new rows from transformers' own
  initialisation (keyed by the module's name: the same on every start), named in one notice;
- the head's names are transformers' placeholders (LABEL_0, LABEL_1, ...: from_pretrained wrote no names): they name
  no class, so the data's names (sorted) take the rows in order when there are as many, which a notice says;
- the data shares no name with the head, or an unnamed head has another number of rows: refused in one line, since
  the head's rows would be trained as other classes; `model.new_head=true` starts a new head of the data's names.

A folder without a head (a body, a masked-LM BERT) gets a new one as before (`start_weights`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel_train.core.task import DEFAULT
from parallel_train.errors import UserError
from parallel_train.models import hf_loading


@dataclass(frozen=True)
class Head:
    """The head a model folder's weights hold."""

    names: list[str]  # its config.json's id2label, by row
    tensors: list[str]  # the model's names of the weights whose rows are its classes (classifier.weight, ...)

    @property
    def named(self) -> bool:
        """False for transformers' placeholders LABEL_0, LABEL_1, ... (no class names)."""
        return self.names != placeholders(len(self.names))


def placeholders(n: int) -> list[str]:
    return [f"LABEL_{i}" for i in range(n)]


def label_sized(model: torch.nn.Module, task: str, hf_path: str) -> list[str]:
    """The model's tensors whose shape follows its number of labels: those that change when it is built (on the meta
    device, no memory) with one label more."""
    config = copy.deepcopy(model.config)
    config.num_labels = config.num_labels + 1
    with torch.device("meta"):
        probe = hf_loading.build_model(config, task, hf_path, "float32").state_dict()
    return [name for name, t in model.state_dict().items() if name in probe and probe[name].shape != t.shape]


def folder_head(
    model: torch.nn.Module, names: list[str], task: str, hf_path: str, files: list[Path], aliases: dict[str, str]
) -> Head | None:
    """The head the weight files hold for `model` (built with the run's labels), named `names` (the folder's id2label),
    or None when they hold none (a body: its head is new)."""
    shapes = hf_loading.file_shapes(files)
    held = [name for name in label_sized(model, task, hf_path) if aliases.get(name, name) in shapes]
    return Head(names, held) if held else None


def head_names(cfg: Any) -> list[str] | None:
    """The class names of the pretrained head a model.name=hf run keeps (its folder's id2label, when its weights hold a
    head with names), which the data's class ids follow; None when the run starts a new head or has none to keep."""
    if not cfg.hf_pretrained or cfg.new_head:
        return None
    config = hf_loading.load_config(cfg.hf_path)
    names = [config.id2label[i] for i in range(len(config.id2label))]
    if names == placeholders(len(names)):
        return None
    with torch.device("meta"):
        model = hf_loading.build_model(config, cfg.task, cfg.hf_path, "float32")
    files = hf_loading.weight_files(cfg.hf_path)
    return names if folder_head(model, names, cfg.task, cfg.hf_path, files, hf_loading.file_keys(model, files)) else None


def kept_rows(head: Head, labels: list[str], new_head: bool, what: str) -> tuple[dict[str, int], str | None]:
    """({tensor: the rows its files give}, the notice) for a run of class names `labels` on `head`; {} with new_head
    (every row of the head starts anew). Refuses names that would train the head's rows as other classes."""
    n, shown = len(head.names), ", ".join(labels[:6]) + (", ..." if len(labels) > 6 else "")
    if new_head:
        return {}, (
            f"notice: model.new_head=true: the head of {what} ({n} classes: {', '.join(head.names[:4])}{', ...' if n > 4 else ''}) "
            f"starts anew from transformers' own initialisation, with the data's {len(labels)} classes ({shown})"
        )
    if not head.named:
        if len(labels) != n:
            raise UserError(
                f"model.new_head: the head of {what} has {n} rows without class names (LABEL_0, ...) and the data has {len(labels)} "
                f"classes ({shown}); set model.new_head=true to start a new head of {len(labels)}"
            )
        pairs = ", ".join(f"LABEL_{i} is {name!r}" for i, name in enumerate(labels[:4])) + (", ..." if n > 4 else "")
        return {t: n for t in head.tensors}, (
            f"notice: the head of {what} names its {n} rows LABEL_0.. (no class names): the data's classes take them in order ({pairs})"
        )
    if labels[:n] != head.names:
        raise UserError(
            f"model.new_head: the data's classes ({shown}) are not those of the head of {what} ({', '.join(head.names[:6])}"
            f"{', ...' if n > 6 else ''}), whose rows would be trained as other classes; name the data's labels as the head does, "
            "or set model.new_head=true to start a new head"
        )
    new = labels[n:]
    if not new:
        return {t: n for t in head.tensors}, None
    return {t: n for t in head.tensors}, (
        f"notice: the data's classes {', '.join(map(repr, new[:6]))}{', ...' if len(new) > 6 else ''} are not among the {n} of the "
        f"head of {what}: it grows to {len(labels)} rows, the new ones from transformers' own initialisation; its {n} rows keep "
        "their weights and names"
    )


def start_weights(
    model: Any, labels: list[str] | None, folder_names: list[str], new_head: bool
) -> tuple[list[str], dict[str, int], str | None]:
    """(the weights the folder does not give, which start from transformers' own initialisation: absent, or of another
    shape (hf_loading.new_weights); {a head's weight that grows: the rows its files give} (hf_head.py); the one notice
    that names them), for a pretrained `model` (models/hf.py HFModel). A causal LM must hold all of its own."""
    if model.task == DEFAULT:
        return [], {}, None
    aliases = {**model.tied, **model.weight_aliases}
    converted = model.weight_conversions.shapes if model.weight_conversions else None
    fresh = hf_loading.new_weights(model, model.pretrained_files(), aliases, converted)
    what = f"model.hf_path {model.hf_path!r}"
    if len(fresh) == len(model.state_dict()):
        raise UserError(
            f"{what} holds none of the weights of its {model.hf.config.model_type} model; give the folder save_pretrained wrote"
        )
    head = folder_head(model.hf, folder_names, model.task, model.hf_path, model.pretrained_files(), aliases) if labels else None
    grown, notices = {}, []
    if head is not None:  # the folder's head: its rows keep their names, or model.new_head=true starts it anew
        kept, notice = kept_rows(head, labels, new_head, what)
        grown = {name: rows for name, rows in kept.items() if name in fresh}  # rows the files give, and new ones
        fresh = [name for name in fresh if name not in grown] + [t for t in head.tensors if new_head and t not in fresh]
        notices += [notice] if notice else []
    others = [name for name in fresh if head is None or name not in head.tensors]
    if others:
        names = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        notices.append(
            f"notice: {what} gives no weights for {names} (a new model.task={model.task} head on its pretrained body): they "
            "start from transformers' own initialisation, as from_pretrained gives them"
        )
    return fresh, grown, "; ".join(notices) or None
