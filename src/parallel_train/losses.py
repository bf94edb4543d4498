"""The training loss. Change it here to train with your own objective.

`per_sample_loss` returns one value per sample so that evaluation can gather exact per-sample losses
across ranks (no duplicates on an uneven last batch); training uses their mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim, averaged over every other dim but the batch: (B, ..., V) -> (B,)."""
    losses = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none")
    return losses.view(targets.shape[0], -1).mean(dim=1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean loss of a batch: equal to the mean over all tokens, since every sample has as many."""
    return per_sample_loss(logits, targets).mean()
