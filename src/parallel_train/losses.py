"""The training loss, per token. Change `token_losses` to train with your own objective.

Every loss here counts tokens, not samples: `token_losses` gives one loss per target position (0 where the
target is IGNORE_INDEX: padding, a prompt the model should not learn to write), and the optimizer step divides
the sum over all its micro-batches and all data-parallel ranks by the number of valid targets of that whole step
(step.py), as torchtitan does with its global valid tokens. So a 5-token answer weighs 5 tokens, not one sample,
and the loss is the same on 1 process, on 8, with accumulation or in a pipeline. Evaluation uses the same sums
(eval_metrics.py): val loss and val accuracy are both per token.

Under tensor parallelism (`parallel.tp`) the logits can stay cut by vocabulary and plain cross-entropy run on the
shards (loss parallel, parallel/sharding.py), which no other objective can. So the engines ask `plain_cross_entropy`
whether `token_losses` and the task's `loss_sum` are plain cross-entropy, by their values on a small fixed probe (not
by their names: the shipped function, or a rewrite of it, is plain; one edited into label smoothing or a z-loss is
not). Plain: loss parallel computes it (`cross_entropy_sum`, the same numbers). Anything else: the logits are gathered
whole and your function runs on them, with a notice of what that costs; evaluation does the same, so every topology
trains and reports the same loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from parallel_train.errors import UserError

IGNORE_INDEX = -100  # a target with this value counts nowhere (F.cross_entropy's default ignore_index)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every target position, shaped like `targets` ((B, T) for text, (B,) for classes), 0 where
    the target is IGNORE_INDEX. Logits in float32: a bf16 log-softmax over a large vocabulary loses precision. Also
    what loss parallel computes on logits cut by vocabulary (a DTensor, inside torch's `loss_parallel`)."""
    losses = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return losses.view(targets.shape)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss of every target position, shaped like `targets`, 0 where the target is IGNORE_INDEX: plain
    cross-entropy. Replace it to train with your own objective (docs/guide.md, section 3: label smoothing)."""
    return cross_entropy(logits, targets)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss of a micro-batch's valid targets (the optimizer step divides by the step's count)."""
    return token_losses(logits, targets).sum()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_sum` of plain cross-entropy: what the engines run under loss parallel (`plain_cross_entropy`)."""
    return cross_entropy(logits, targets).sum()


def plain_cross_entropy(task_loss_sum=None) -> bool:
    """Whether `token_losses` (and `task_loss_sum`, the task's loss_sum) compute plain cross-entropy: their values on a
    fixed probe (random logits over 7 classes, one target IGNORE_INDEX) equal F.cross_entropy's to float tolerance.
    The same answer on every rank (same code, same probe), with no collective. A function that raises on the probe (a
    vocabulary size written into it) is not plain: it will run on gathered logits, as on one process."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 3, 7, generator=generator)
    targets = torch.randint(0, 7, (2, 3), generator=generator)
    targets[0, 1] = IGNORE_INDEX
    want = cross_entropy(logits, targets)
    try:
        got = token_losses(logits.clone(), targets.clone())
        total = (task_loss_sum or loss_sum)(logits.clone(), targets.clone())
        return _close(got, want) and _close(total, want.sum())
    except Exception:  # the user's code: whatever it raises, it is not plain cross-entropy
        return False


def _close(got, want: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got.float(), want, rtol=1e-5, atol=1e-6)


def valid_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many targets count (not IGNORE_INDEX), as an int64 tensor."""
    return (targets != IGNORE_INDEX).sum()


def valid_on_host(targets: torch.Tensor) -> int:
    """How many targets count, read on the host from a batch not yet moved: `.numpy()` exists for CPU tensors only, so
    this never waits for a device (the optimizer step counts its batches so: step.py). A batch a loader placed on a
    device already is counted there and read: one sync."""
    if targets.device.type == "cpu":
        return int(np.count_nonzero(targets.numpy() != IGNORE_INDEX))
    return int(valid_tokens(targets))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss per valid token of one batch (scripts and tests; training divides by the whole step's count)."""
    return loss_sum(logits, targets) / valid_tokens(targets).clamp(min=1)


def logits_of(output: Any) -> torch.Tensor:
    """The logits in what a model's forward returned: the tensor itself, or the `logits` of a transformers ModelOutput
    or a dict. Anything else is one line naming what the task needs (the run cannot compute its loss)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    has = f"keys {', '.join(map(str, output))}" if isinstance(output, Mapping) else type(output).__name__
    raise UserError(
        f"the model's forward returned {has} without 'logits': the loss and the metrics need the logits; "
        "return the logits tensor, or an output (dict or transformers ModelOutput) with a 'logits' entry"
    )
