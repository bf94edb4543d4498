"""Validation metrics: what evaluation reports. Add yours to METRICS; each is logged as `val_<name>`.

A metric comes in two parts, so that it is exact on any number of processes and pipeline stages:
- `stats(logits, targets)`: a (batch, K) tensor of K numbers per sample that add up over the validation set
  (correct tokens and tokens; true/false positives; n-gram matches and lengths for BLEU);
- `value(totals)`: the metric from those K numbers summed over the whole validation set.
Evaluation (evaluation.py) sums the statistics of every sample exactly once, across ranks (each rank takes its
slice of every global validation batch), so a ratio of sums (a micro-average over tokens) or a corpus-level score
comes out the same on 1 process as on 64.

`loss` must stay: the trainer reads it (val_loss, best checkpoint). Like training, it is per token: the summed
`token_losses` over the summed count of valid targets (IGNORE_INDEX, padding, counts nowhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parallel_train.losses import IGNORE_INDEX, token_losses


@dataclass(frozen=True)
class Metric:
    stats: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> (batch, K)
    value: Callable[[list[float]], float | None]  # the K totals -> the reported number (None: not measured)


def loss_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(sample's summed token loss, its valid targets): their ratio of sums is the loss per token."""
    losses = token_losses(logits, targets).reshape(targets.shape[0], -1)
    real = (targets != IGNORE_INDEX).reshape(targets.shape[0], -1)
    return torch.stack([losses.sum(dim=1), real.sum(dim=1).to(losses.dtype)], dim=1)


def accuracy_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(correct predictions, real targets) per sample: their ratio of sums is the accuracy over all targets."""
    real = (targets != IGNORE_INDEX).reshape(targets.shape[0], -1)
    correct = (logits.argmax(dim=-1) == targets).reshape(targets.shape[0], -1) & real
    return torch.stack([correct.sum(dim=1), real.sum(dim=1)], dim=1)


def ratio(totals: list[float]) -> float | None:
    """None when nothing was counted (validation batches with no token to learn): not measured, written as null."""
    return totals[0] / totals[1] if totals[1] else None


METRICS: dict[str, Metric] = {
    "loss": Metric(loss_stats, ratio),
    "accuracy": Metric(accuracy_stats, ratio),  # of next-token (or class) predictions
}


def metric_stats(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every metric's per-sample statistics: {name: (batch, K)}, float64 so that sums stay exact."""
    targets = targets.to(logits.device)
    return {name: m.stats(logits, targets).to(torch.float64) for name, m in METRICS.items()}


def add_totals(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two sets of summed statistics added up (`a` None: nothing summed yet)."""
    return b if a is None else {name: a[name] + b[name] for name in b}


def add_stats(totals: dict[str, torch.Tensor] | None, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Running sums over samples: totals + the column sums of one batch's statistics."""
    return add_totals(totals, {name: s.sum(dim=0) for name, s in stats.items()})


def metric_values(totals: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """The metrics from their statistics summed over the validation set. None where a metric was not measured: its
    value is None or not finite (a ratio over nothing; JSON has no NaN, so metrics.jsonl says null)."""
    values = {name: METRICS[name].value(totals[name].tolist()) for name in METRICS}
    return {name: float(v) if v is not None and math.isfinite(v) else None for name, v in values.items()}
