"""Samples of different lengths as batches: padded to the batch's longest, or packed several to a row (data.packing).

A sample is a sequence of token ids with a mask of the tokens the model learns to write (data/chat_format.py). As a
training row, its inputs are ids[:-1] and its targets ids[1:], with -100 (counted nowhere, losses.py) where the
token to predict is not one to learn: a sample of L ids fills L - 1 positions.

- Padded (`PaddedSamples`): each batch is as long as its longest sample, rounded up to a multiple of 8 (kernels
  like aligned shapes; of 8 and parallel.tp, whose sequence parallel cuts every row into tp equal shards), at most
  model.block_size (which tp divides: parallel/sharding.py check_length); the padding's targets are -100, and it comes after each sample's
  own tokens, where causal attention never lets a real token see it. Pipelines and torch.compile want one shape
  for every batch: there every batch is model.block_size long (`fixed`).
- Packed (`PackedSamples`): samples are put into rows of exactly model.block_size positions by best-fit
  decreasing (each sample, longest first, into the row it fills best), computed once when the data is loaded,
  so the rows are the same on every rank and after a resume. A row carries each token's position within its own
  sample (data/batch.py's third element): positions restart at 0 where a sample starts, which is how the model keeps
  the samples apart (a block-diagonal causal mask) and gives each its own positions. The rest of a row is padding,
  a document of its own whose targets are -100.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from parallel_train.losses import IGNORE_INDEX

ALIGN = 8


class Samples(Protocol):
    """Token ids and learn-mask of each sample, in memory (data/sft.py) or memory-mapped (data/prepared.py)."""

    lengths: np.ndarray  # ids per sample

    def __len__(self) -> int: ...

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class SamplesInMemory:
    ids: list[np.ndarray]
    masks: list[np.ndarray]

    def __post_init__(self) -> None:
        self.lengths = np.asarray([len(i) for i in self.ids], dtype=np.int64)
        self.learnable = np.asarray([learnable_tokens(m) for m in self.masks], dtype=np.int64)  # per sample

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[i], self.masks[i]


def learnable_tokens(mask: np.ndarray) -> int:
    """The targets of one sample that the loss counts: its tokens to learn after the first (`training_row`)."""
    return int(np.count_nonzero(np.asarray(mask[1:], dtype=bool)))


def training_row(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one sample: targets are the next ids where the mask says to learn them, else -100."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids[:-1], np.where(np.asarray(mask[1:], dtype=bool), ids[1:], IGNORE_INDEX)


class PaddedSamples(Dataset):
    """One sample per row, each batch padded to its longest (or to block_size when `fixed`)."""

    def __init__(self, samples: Samples, block_size: int, pad_id: int, fixed: bool, align: int = ALIGN):
        self.samples, self.block_size, self.pad_id, self.fixed, self.align = samples, block_size, pad_id, fixed, align

    def __len__(self) -> int:
        return len(self.samples)

    def longest(self) -> int:
        """The index of the longest sample: the widest batch's width (the memory estimate's worst case)."""
        return int(np.argmax(self.samples.lengths))

    def width(self, longest: int) -> int:
        return self.block_size if self.fixed else min(self.block_size, -(-longest // self.align) * self.align)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [training_row(*self.samples.get(i)) for i in indices]
        width = self.width(max(len(x) for x, _ in rows))
        x = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        y = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        for r, (xi, yi) in enumerate(rows):
            x[r, : len(xi)], y[r, : len(yi)] = xi, yi
        return torch.from_numpy(x), torch.from_numpy(y)


def pack(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the sample indices of each row, every row holding at most `capacity` positions; within a
    row, samples keep their order in the data. Deterministic (ties by index)."""
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    space: list[tuple[int, int]] = []  # (free positions, row), sorted
    rows: list[list[int]] = []
    for i in order:
        need = int(sizes[i])
        at = bisect.bisect_left(space, (need, -1))
        if at == len(space):  # no row has room: a new one
            rows.append([i])
            bisect.insort(space, (capacity - need, len(rows) - 1))
        else:
            free, row = space.pop(at)
            rows[row].append(i)
            bisect.insort(space, (free - need, row))
    return [sorted(r) for r in rows]


class PackedSamples(Dataset):
    """Rows of exactly block_size positions, each holding whole samples (`pack`): (inputs, targets, positions)."""

    def __init__(self, samples: Samples, block_size: int, pad_id: int):
        self.samples, self.block_size, self.pad_id = samples, block_size, pad_id
        self.rows = pack(samples.lengths - 1, block_size)

    def __len__(self) -> int:
        return len(self.rows)

    def padding_share(self) -> float:
        """The share of positions that hold no sample's token (padding)."""
        return 1 - float((self.samples.lengths - 1).sum()) / (len(self.rows) * self.block_size)

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pieces = [training_row(*self.samples.get(i)) for i in self.rows[r]]
        rest = self.block_size - sum(len(x) for x, _ in pieces)  # padding: a document of its own, learned nowhere
        x = np.concatenate([p[0] for p in pieces] + [np.full(rest, self.pad_id)])
        y = np.concatenate([p[1] for p in pieces] + [np.full(rest, IGNORE_INDEX)])
        positions = np.concatenate([np.arange(len(p[0])) for p in pieces] + [np.arange(rest)])
        return x, y, positions

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = [self.row(r) for r in indices]
        return tuple(torch.from_numpy(np.stack([p[k] for p in parts]).astype(np.int64)) for k in range(3))
