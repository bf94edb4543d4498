"""Validation metrics on logits cut by vocabulary (loss parallel under tensor parallelism), without gathering them.

Under `parallel.tp` the output layer keeps its logits cut by vocabulary (parallel/sharding.py): each tensor-parallel
rank holds (batch, T, vocab / tp). Gathering them whole for evaluation would put batch x T x vocab floats on every
rank at once (16 x 8192 x 128256 in fp32 is 64 GiB: more than training ever holds), so the task's own metrics run on
the shards, each with a few numbers per token crossing ranks:
- loss (and perplexity, from the same statistics): torch's `loss_parallel` cross-entropy, per token
  (reduction="none"): log-sum-exp and the target's logit, each all-reduced over the tensor-parallel ranks. That is
  `token_losses` itself: the engines keep the logits cut only when it is plain cross-entropy
  (losses.plain_cross_entropy); for any other loss they are gathered whole, in training and here alike;
- accuracy: each rank's best logit and its index in the whole vocabulary, all-gathered; the first rank holding the
  largest wins, which is the lowest index among equal maxima, as `argmax` over the whole row picks.
Any other metric (a user's, METRICS of your own, F1 of classes) gets the logits gathered whole once per batch, as
before: write its sharded twin here to spare that. Every tensor-parallel rank runs these (collectives); one reports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallel_train.eval_metrics import Metric, accuracy_stats, loss_stats, per_sample_correct, per_sample_losses, stats_by
from parallel_train.losses import cross_entropy


def cut_by_vocabulary(logits: torch.Tensor) -> bool:
    """Whether `logits` is a DTensor cut along its last dimension (loss parallel's output)."""
    if not isinstance(logits, DTensor):
        return False
    return any(p.is_shard() and p.dim in (-1, logits.ndim - 1) for p in logits.placements)


def sharded_loss_stats(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        losses = cross_entropy(logits, targets)
    return per_sample_losses(losses.to_local().view(targets.shape), targets)  # replicated: every rank the same


def vocabulary_argmax(logits: DTensor) -> torch.Tensor:
    """argmax over the last dimension of logits cut along it, as a plain tensor on every rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = logits.to_local()
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    best, where = local.max(dim=-1)  # the first maximum of this rank's slice
    group = logits.device_mesh.get_group()
    bests, wheres = ([torch.empty_like(t) for _ in range(dist.get_world_size(group))] for t in (best, where))
    dist.all_gather(bests, best.contiguous(), group=group)
    dist.all_gather(wheres, (where + offset[-1]).contiguous(), group=group)
    winner = torch.stack(bests).argmax(dim=0, keepdim=True)  # the first rank with the largest: the lowest index
    return torch.stack(wheres).gather(0, winner).squeeze(0)


def sharded_accuracy_stats(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    return per_sample_correct(vocabulary_argmax(logits), targets)


SHARDED = {loss_stats: sharded_loss_stats, accuracy_stats: sharded_accuracy_stats}


def stats_on_shards(logits: DTensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> dict[str, torch.Tensor]:
    """eval_metrics.metric_stats for logits cut by vocabulary: the task's metrics on the shards, others on the logits
    gathered whole (once). A collective: every tensor-parallel rank calls it."""
    targets, whole = targets.to(logits.device), []

    def compute(stats):
        if stats in SHARDED:
            return SHARDED[stats](logits, targets)
        if not whole:
            whole.append(logits.full_tensor())
        return stats(whole[0], targets)

    return stats_by(compute, metrics)
