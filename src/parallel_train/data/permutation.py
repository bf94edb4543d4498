"""A seeded permutation of [0, n) that costs O(1) memory: position -> sample, computed, never stored.

`torch.randperm(n)` holds n int64s (8 GB for a billion windows) and neither torch nor numpy has a permutation
that can be evaluated at one position without building the whole, so this one is written here: a Feistel
network over the smallest number of bits that covers n (unbalanced when that number is odd: the two halves
swap widths every round, which keeps every round invertible), with cycle-walking: a value that lands at or
past n is permuted again until it falls inside [0, n). The network is a bijection of [0, 2^bits), so this is
a bijection of [0, n); as 2^bits < 2n, fewer than 2 trips are needed on average. The round function is the
splitmix64 finalizer of (half, round key); the round keys come from (seed, epoch). Vectorized over numpy
uint64 arrays, and computed a block of positions at a time (positions are read in order), so a batch costs
microseconds.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
BLOCK = 4096  # positions computed at once and kept (32 KB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1, MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of every element (uint64 arithmetic wraps around, as intended)."""
    z = z + GOLDEN
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


class SeededPermutation:
    """perm(epoch, positions) -> samples: for each epoch a different permutation of [0, n), from the seed alone."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n, self.seed = n, seed
        self.bits = max(2, (n - 1).bit_length())
        self._block: tuple[int, int, np.ndarray] | None = None  # (epoch, first position, samples)

    def _round_keys(self, epoch: int) -> np.ndarray:
        base = np.array([(self.seed * 1_000_003 + epoch) & (2**64 - 1)], dtype=np.uint64)
        return splitmix64(splitmix64(base) + np.arange(1, ROUNDS + 1, dtype=np.uint64))

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left_bits = self.bits // 2
        right_bits = self.bits - left_bits
        left, right = x >> np.uint64(right_bits), x & np.uint64((1 << right_bits) - 1)
        for key in keys:  # (L, R) -> (R, L ^ F(R)): the widths swap, each round is invertible
            mixed = splitmix64(right ^ key) & np.uint64((1 << left_bits) - 1)
            left, right = right, left ^ mixed
            left_bits, right_bits = right_bits, left_bits
        return (left << np.uint64(right_bits)) | right

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at `positions` (each in [0, n)) of epoch `epoch`'s order, as int64."""
        keys = self._round_keys(epoch)
        out = self._feistel(np.asarray(positions, dtype=np.uint64), keys)
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle-walking: permute again until inside [0, n)
            out[outside] = self._feistel(out[outside], keys)
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def take(self, epoch: int, start: int, count: int) -> np.ndarray:
        """Samples at positions start .. start + count - 1 of one epoch (through a cached block when it covers them)."""
        first = start - start % BLOCK
        if count > BLOCK or start + count > first + BLOCK:
            return self(epoch, np.arange(start, start + count, dtype=np.uint64))
        if self._block is None or self._block[:2] != (epoch, first):
            end = min(first + BLOCK, self.n)
            self._block = (epoch, first, self(epoch, np.arange(first, end, dtype=np.uint64)))
        return self._block[2][start - first : start - first + count]
