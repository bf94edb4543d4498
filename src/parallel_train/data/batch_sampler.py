"""The batch sampler that makes every topology read the same data.

The samples of optimizer step k depend only on the seed and the global batch size (batch_size x world_size x
gradient_accumulation_steps). One seeded permutation per epoch orders all samples (as `DistributedSampler`
does); global batch k is the next slice of it, cut into one contiguous piece per (micro-step, rank). So 2 ranks
x batch 4, 1 rank x batch 8 and 4 micro-steps x batch 2 see the same 8 samples at every step, and resuming at
step k needs nothing but k.

The permutation is `torch.randperm` (order="randperm": the in-memory text data, whose order the published
baselines and the resume tests fix) or data/permutation.py's `SeededPermutation` (order="seeded": prepared data),
computed at each position, so that memory does not grow with the number of samples.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from parallel_train.data.permutation import SeededPermutation

ORDERS = ("randperm", "seeded")


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices for each micro-step, from `start_step` on, forever.

    Stream position p holds sample perm_e[p % N] with e = p // N (one seeded permutation per epoch).
    Micro-step m of the run covers stream positions [m*W*B, (m+1)*W*B); rank r takes the r-th slice of B.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        start_micro_step: int = 0,
        order: str = "randperm",
        with_epoch: bool = False,
    ):
        assert order in ORDERS, order
        self.with_epoch = with_epoch  # yield epoch * num_samples + index: the dataset learns which epoch draws it
        self.n, self.batch_size, self.world_size, self.rank, self.seed = num_samples, batch_size, world_size, rank, seed
        self.start_micro_step = start_micro_step
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)
        self._seeded = SeededPermutation(num_samples, seed) if order == "seeded" else None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def _slice(self, epoch: int, offset: int, take: int) -> list[int]:
        """Positions offset .. offset + take - 1 of epoch `epoch`'s order."""
        if self._seeded is not None:
            return self._seeded.take(epoch, offset, take).tolist()
        return self._permutation(epoch)[offset : offset + take].tolist()

    def indices_at(self, micro_step: int) -> list[int]:
        start = (micro_step * self.world_size + self.rank) * self.batch_size
        out: list[int] = []
        pos = start
        while pos < start + self.batch_size:  # a batch may straddle two epochs
            epoch, offset = divmod(pos, self.n)
            take = min(self.n - offset, start + self.batch_size - pos)
            out.extend(epoch * self.n + i if self.with_epoch else i for i in self._slice(epoch, offset, take))
            pos += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        m = self.start_micro_step
        while True:
            yield self.indices_at(m)
            m += 1
