"""A seeded permutation of [0, n) that costs O(1) memory: position -> sample, computed, never stored.

`torch.randperm(n)` holds n int64s (8 GB for a billion windows) and neither torch nor numpy has a permutation
that can be evaluated at one position without building the whole, so this one is written here: a balanced
Feistel network over the smallest even number of bits that covers n, with cycle-walking (a value that lands
at or past n is permuted again until it falls inside [0, n); since the network is a bijection of the larger
domain, this is a bijection of [0, n), and as the domain is under 4n, fewer than 4 rounds trips on average).
The round function is the splitmix64 finalizer of (half, round key); the round keys come from (seed, epoch).
Vectorized over numpy uint64 arrays: a batch of positions costs microseconds.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
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
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2  # each half of the Feistel network holds this many bits
        self.mask = np.uint64((1 << self.half) - 1)

    def _round_keys(self, epoch: int) -> np.ndarray:
        base = np.array([(self.seed * 1_000_003 + epoch) & (2**64 - 1)], dtype=np.uint64)
        return splitmix64(splitmix64(base) + np.arange(1, ROUNDS + 1, dtype=np.uint64))

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in keys:
            left, right = right, left ^ (splitmix64(right ^ key) & self.mask)
        return (left << h) | right

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
        """Samples at positions start .. start + count - 1 of one epoch."""
        return self(epoch, np.arange(start, start + count, dtype=np.uint64))
