"""What a batch is, for every engine: a dict of named tensors, as transformers and accelerate users write them, or
the template's own tuples.

    dict     {"input_ids": (B, T), "attention_mask": (B, T), "token_type_ids": ..., "labels": ...} or
             {"pixel_values": (B, C, H, W), "labels": (B,)}: the model is called `model(main, **others)`, where
             main is the first of MAIN_INPUTS the batch holds and others are every key but "labels"
    tuple    (inputs, targets), or (inputs, targets, positions) for packed samples:
      inputs     (B, T) token ids (or (B, F) feature vectors): what `model(inputs)` takes
      targets    (B, T) next-token ids, or (B,) class labels
      positions  (B, T) each token's position inside its own sample, only when several samples are packed into one
                 row (data.packing, data/packing.py): a sample starts where its positions restart, so the positions
                 say both where each token sits and where the documents are; the model is then called
                 `model(inputs, positions=positions)` and keeps documents apart (models/document_mask.py,
                 transformers' own packed-sequence masks)

Labels (a dict's "labels", a tuple's targets) are aligned with the model's logits (tasks.py); IGNORE_INDEX (-100)
counts nowhere (losses.py). Every tensor's first dimension is the sample: the data-parallel split (`rows`) and the
micro-batch split of a pipeline cut every tensor of the batch along it. Every engine calls the model the same way
(step.py's micro-batches, the pipelines' schedules, evaluation.py): a tuple of two elements calls the model exactly
as before, so the default path is unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from parallel_train.errors import UserError

Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
LABELS = "labels"
LABEL = "label"  # the name of Hugging Face datasets' class column, which transformers' collators rename to LABELS
MAIN_INPUTS = ("input_ids", "pixel_values", "inputs_embeds", "input_values")


def with_labels(batch: Batch) -> Batch:
    """A dict batch's "label" key named "labels", as transformers' data collators rename it (a batch that has both keeps
    both, and the model is asked to take "label"); anything else as it is."""
    if not isinstance(batch, Mapping) or LABEL not in batch or LABELS in batch:
        return batch
    return {LABELS if k == LABEL else k: v for k, v in batch.items()}


def main_key(batch: Mapping[str, torch.Tensor]) -> str:
    """The key of the model's first argument: the first of MAIN_INPUTS present, else the first key not a label."""
    for key in MAIN_INPUTS:
        if key in batch:
            return key
    return next(k for k in batch if k != LABELS)


def parts(batch: Batch, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(the model's first argument, the labels, the model's keyword arguments), moved to `device` when given."""
    if isinstance(batch, Mapping):
        main = main_key(batch)
        x, y = batch[main], batch[LABELS]
        rest = {k: v for k, v in batch.items() if k not in (main, LABELS)}
    else:
        x, y, *others = batch
        rest = {"positions": others[0]} if others else {}
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        rest = {k: v.to(device, non_blocking=True) for k, v in rest.items()}
    return x, y, rest


def targets(batch: Batch) -> torch.Tensor:
    """The labels (aligned with the logits)."""
    return batch[LABELS] if isinstance(batch, Mapping) else batch[1]


def size(batch: Batch) -> int:
    """Samples in the batch."""
    return len(targets(batch))


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    """Samples lo..hi-1 of every tensor (a data-parallel rank's slice of a global batch)."""
    if isinstance(batch, Mapping):
        return {k: v[lo:hi] for k, v in batch.items()}
    return tuple(t[lo:hi] for t in batch)


def concat(batches: list[Batch]) -> Batch:
    """Several batches as one (a pipeline schedule cuts it into its micro-batches again)."""
    if isinstance(batches[0], Mapping):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return tuple(torch.cat(ts) for ts in zip(*batches, strict=True))


def repeat(sample: Batch, n: int) -> Batch:
    """A batch of `n` copies of one unbatched sample (the memory estimator's micro-batch: only shapes matter)."""
    if isinstance(sample, Mapping):
        return {k: torch.stack([v] * n) for k, v in sample.items()}
    return tuple(torch.stack([t] * n) for t in sample)


def widest_sample(dataset) -> Batch:
    """One sample, unbatched, at the widest shape a batch of `dataset` takes: the longest of padded samples (a batch is
    padded to its longest, data/packing.py), else the first. Datasets that only batch themselves (`__getitems__`) are
    asked for a batch of one; a dataset that knows its widest sample (`widest()`: each key at its own widest) gives it."""
    if hasattr(dataset, "widest"):
        return dataset.widest()
    i = dataset.longest() if hasattr(dataset, "longest") else 0
    if hasattr(dataset, "__getitems__"):
        one = dataset.__getitems__([i])
        return with_labels({k: v[0] for k, v in one.items()}) if isinstance(one, Mapping) else tuple(t[0] for t in one)
    return with_labels(dataset[i])


def named_inputs(forward: Callable) -> tuple[str, ...]:
    """The keyword inputs `forward` names, after its first (the main input): what a model promises to take in
    every pipeline stage, as it takes a packed batch's positions (a part it does not hold is None there)."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def refuse_other_inputs(kwargs: dict[str, Any], where: str, allowed: tuple[str, ...] = ("positions",)) -> None:
    """One line when a batch brings keyword inputs that `where` (a layout) cannot hand to its model's stages: every
    stage gets the inputs its forward names (`allowed`: named_inputs), a forward's **kwargs reach none."""
    other = [k for k in kwargs if k not in allowed]
    if other:
        raise UserError(
            f"the batch's {other[0]!r} input cannot travel through {where}, which passes the main input"
            f"{' and ' + ', '.join(allowed) if allowed else ''} (the inputs the model's forward names) to its stages; "
            f"name {other[0]!r} in the forward's arguments (every stage then gets it, and a stage skips what it does not hold), "
            "train without pipeline stages (data parallel, parallel.dp_shard or parallel.tp), or drop that key from the batch"
        )


def takes(forward: Callable, key: str) -> bool:
    """Whether `forward` takes the keyword argument `key`: by that name, or any name (**kwargs)."""
    params = inspect.signature(forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD or (p.name == key and p.kind is not p.POSITIONAL_ONLY) for p in params)


def check_model_takes(forward: Callable, batch: Batch, cfg: Any, task_data: bool) -> None:
    """At start, before the first step: the model's forward takes every input the batch gives (the model is called
    `model(main, **others)`), or one line names the key and the model. Without it the first step would end in a
    TypeError from inside the engine, or, on a pipeline, in a hang of the other stages. `task_data`: the batch is
    model.task's own loader's, not data.source's."""
    _, _, others = parts(batch)
    for key in others:
        if not takes(forward, key):
            where = f"model.task={cfg.model.task}'s data" if task_data else f"data.source={cfg.data.source}"
            raise UserError(
                f"data gives {key!r}, which model.name={cfg.model.name}'s forward does not take ({where}); "
                f"give the forward a {key!r} argument (or **kwargs), or drop {key!r} from the data's batches"
            )
