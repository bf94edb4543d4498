"""What a batch is, for every engine: `(inputs, targets)`, or `(inputs, targets, positions)` for packed samples.

    inputs     (B, T) token ids (or (B, F) feature vectors): what `model(inputs)` takes
    targets    (B, T) next-token ids, or (B,) class labels; IGNORE_INDEX (-100) counts nowhere (losses.py)
    positions  (B, T) each token's position inside its own sample, only when several samples are packed into one
               row (data.packing, data/packing.py): a sample starts where its positions restart, so the positions say
               both where each token sits and where the documents are; the model is then called
               `model(inputs, positions=positions)` and keeps documents apart (models/document_mask.py,
               transformers' own packed-sequence masks)

Every engine passes the third element through the same way (step.py's micro-batches, the pipelines' schedules,
evaluation.py): a batch of two elements calls the model exactly as before, so the default path is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

Batch = tuple[torch.Tensor, ...]


def parts(batch: Batch, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(inputs, targets, the model's keyword arguments), moved to `device` when given."""
    x, y, *rest = batch
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        rest = [t.to(device, non_blocking=True) for t in rest]
    return x, y, ({"positions": rest[0]} if rest else {})


def targets(batch: Batch) -> torch.Tensor:
    return batch[1]


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    """Samples lo..hi-1 of every element (a data-parallel rank's slice of a global batch)."""
    return tuple(t[lo:hi] for t in batch)


def concat(batches: list[Batch]) -> Batch:
    """Several batches as one (a pipeline schedule cuts it into its micro-batches again)."""
    return tuple(torch.cat(ts) for ts in zip(*batches, strict=True))
