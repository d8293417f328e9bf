"""A keyed pseudo-random permutation of ``range(n)`` computed per index, in O(1) memory.

A 4-round Feistel network on the smallest even bit width covering ``n``, with cycle walking
to stay inside ``[0, n)``. Applying it to every index of ``range(n)`` yields each exactly once,
so an epoch order over billions of samples never has to be materialised.
"""

from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROUNDS = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """``perm(indices)`` maps indices in ``[0, n)`` to a bijective shuffle keyed by ``key``."""

    def __init__(self, n: int, key: tuple[int, ...]):
        if n <= 0:
            raise ValueError(f"permutation size must be positive, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        state = np.random.SeedSequence(list(key)).generate_state(_ROUNDS, dtype=np.uint64)
        self.keys = [np.uint64(k) for k in state]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = np.asarray(indices, dtype=np.uint64)
            if x.size and int(x.max()) >= self.n:
                raise IndexError(f"index out of range for a permutation of {self.n}")
            x = self._encrypt(x)
            out_of_range = x >= np.uint64(self.n)
            while out_of_range.any():  # cycle walking: at most a few rounds on average
                x[out_of_range] = self._encrypt(x[out_of_range])
                out_of_range = x >= np.uint64(self.n)
        return x.astype(np.int64)
