"""Evaluation, the same for every engine: the fixed validation set, each sample counted once.

The validation set is `eval.iters` global batches of `eval.batch_size` samples (data.val_batches), the same on
every topology. Each global batch is split across the data-parallel ranks as a training batch is (rank r takes
the r-th slice), every rank runs the engine's forward on its slice, and the metrics' summed statistics
(eval_metrics.py) are added over ranks at the end: 1 process x batch 8 and 2 processes x batch 4 evaluate the
same samples and report the same numbers.

Every rank runs as many forwards, because a forward may be a collective (FSDP2 all-gathers, tensor parallel
all-reduces, pipeline stages send to each other); a rank whose slice is empty (a global batch smaller than the
data-parallel size) runs one sample and counts nothing. Only the ranks that hold the model's output report it
(`engine.eval_forward` returns None elsewhere: tensor-parallel peers compute the same logits, and only the
last pipeline stage has them). Under loss parallel the logits stay cut by vocabulary: every tensor-parallel rank
gets its slice and the metrics run on the slices (parallel/vocab_metrics.py), counted once (`engine.loss_owner`). A metric that fails does so on those ranks alone (a user's metric, eval.metric): the
rank keeps running the forwards the others wait on, and its one-line error travels in the gather at the end, so every
rank stops with that line at once (else the others report a failed collective, or wait out parallel.timeout_s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from parallel_train.core.collectives import all_gather
from parallel_train.data.batch import parts, rows, size
from parallel_train.errors import UserError
from parallel_train.eval_metrics import Metric, add_stats, add_totals, metric_stats, metric_values
from parallel_train.losses import logits_of
from parallel_train.parallel.vocab_metrics import cut_by_vocabulary, stats_on_shards


def rank_slice(n: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Rank `dp_rank`'s contiguous share of n samples: sizes differ by at most one."""
    per, extra = divmod(n, dp_size)
    start = dp_rank * per + min(dp_rank, extra)
    return start, start + per + (dp_rank < extra)


@torch.no_grad()
def evaluate(engine, val_batches, metrics: dict[str, Metric]) -> dict[str, float | None]:
    """Each of `metrics` ("loss" first: eval_metrics.chosen_metrics) over the validation set. A collective: every
    rank calls it."""
    engine.set_training(False)
    totals, failed = None, None
    for batch in val_batches:
        lo, hi = rank_slice(size(batch), engine.dp_size, engine.dp_rank)
        empty = hi == lo
        xs, ys, kwargs = parts(rows(batch, 0, 1) if empty else rows(batch, lo, hi))
        logits = engine.eval_forward(xs, **kwargs)
        if logits is not None and not empty and failed is None:
            logits = logits_of(logits)
            try:  # logits cut by vocabulary (loss parallel): every tensor-parallel rank computes, one counts
                stats = stats_on_shards(logits, ys, metrics) if cut_by_vocabulary(logits) else metric_stats(logits, ys, metrics)
            except UserError as e:  # said by every rank after the gather (module docstring)
                failed = str(e)
            else:
                totals = add_stats(totals, stats) if engine.loss_owner else totals
    engine.set_training(True)  # before the values: a user's value function that fails leaves the model training (trainer.py saves it)
    return metric_values(sum_over_ranks(totals, failed), metrics)


def sum_over_ranks(totals: dict[str, torch.Tensor] | None, failed: str | None = None) -> dict[str, torch.Tensor]:
    """Every rank's summed statistics added up (ranks without any add nothing): a few numbers per rank. `failed`: this
    rank's metric error, raised on every rank once all have gathered."""
    parts = all_gather(failed if failed is not None else {k: v.cpu() for k, v in totals.items()} if totals is not None else None)
    errors = [part for part in parts if isinstance(part, str)]
    if errors:
        raise UserError(errors[0])
    summed = None
    for part in filter(None, parts):
        summed = add_totals(summed, part)
    return summed


def evaluate_or_stop(engine, batches, metrics: list[Metric], step: int, save: Callable[[], Path]) -> dict[str, float | None]:
    """`evaluate`, where a metric that fails (eval.metric: every rank raises alike) stops the run after `save` wrote
    step `step`'s checkpoint (a collective, as the evaluation was: every rank is here) and returned its folder."""
    try:
        return evaluate(engine, batches, metrics)
    except UserError as e:
        where = save()
        raise UserError(f"{e} (step {step}'s checkpoint is written first: {where}; a rerun resumes from it)") from None
