"""Tijdeman's apportionment of stream positions to the sources of a blend, a block at a time.

Tijdeman's rule (1980) is earliest-deadline-first scheduling of unit jobs: source ``i``'s
``k``-th position (``k = 0, 1, ...``) is a job released at the first position ``p`` with
``w_i p - k >= 1/s`` and due by ``(k + 1 - 1/s) / w_i`` (``s = 2(S - 1)``, ``S`` sources,
``w`` the normalised weights); each position takes the released job due first (ties: the lower
source index). That keeps ``|c_i - w_i n| <= 1 - 1/s`` for every prefix ``n``.

:meth:`Apportionment.picks_sequential` decides position by position in exact integers (the
reference). :meth:`Apportionment.sequence` gives the same sources for a block of positions with
a few numpy passes: the jobs sorted by deadline are the earliest-deadline-first order for as long
as each is released by its position (every job due earlier is then already placed). Floating
point only orders and filters; every comparison it cannot decide with a wide margin is made
again in exact integers, so the result is the sequential rule's, position for position. Where a
job is not yet released (the sorted order and the rule part), the exact rule places the next
positions one by one before the block pass resumes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

BLOCK = 4096  # positions sorted in one pass
_KEY_TOL = 1e-12  # relative: float deadlines closer than this are compared exactly
_LONG_RUN = 32  # leave the queue for the sorted order only for at least this many positions
_INT64 = 1 << 62


class Apportionment:
    """Tijdeman's assignment: the source of the ``n``-th position of a segment given the counts
    of the ``n - 1`` before it, with ``|count_i - w_i n| <= 1 - 1/(2(S-1))`` throughout.

    Among the sources that may take a position without exceeding their share by that bound,
    the one whose deadline (when it would fall that far behind) comes first; ties go to the
    lower index.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        fractions = [Fraction(w) for w in weights]  # floats are exact binary fractions
        den = math.lcm(*(f.denominator for f in fractions))
        self.parts = [int(f * den) for f in fractions]
        self.total = sum(self.parts)
        self.slack = 2 * (len(self.parts) - 1)  # 1/(2(S-1)) in units of 1/slack
        self._w = np.array([Fraction(a, self.total) for a in self.parts], dtype=np.float64)
        # sources with equal weights share a class: their deadlines tie exactly at equal k
        classes = {a: i for i, a in reversed(list(enumerate(self.parts)))}
        self._class = np.array([classes[a] for a in self.parts], dtype=np.int64)
        # small weights' ratios (1:1, 1:3, ...): exact int64 deadlines, lcm / a_i apart per k
        self._lcm = math.lcm(*self.parts)
        if self._lcm < _INT64 and self.slack * self.total < _INT64:
            self._lcm_per = np.array([self._lcm // a for a in self.parts], dtype=np.int64)
            self._parts64 = np.array(self.parts, dtype=np.int64)

    # ------------------------------------------------------------------ reference
    def picks_sequential(self, n: int, counts: Sequence[int], m: int) -> list[int]:
        """The sources of positions ``n .. n + m - 1`` (1-based) of the segment, given the
        counts of the ``n - 1`` positions before them, decided one by one in exact integers."""
        parts, total, slack = self.parts, self.total, self.slack
        if len(parts) == 1:
            return [0] * m
        sources = range(len(parts))
        # source i may take position p when slack (a_i p - c_i total) >= total, i.e. when
        # step_i p + base_i >= total; due_i / (slack a_i) is its deadline, in positions
        step = [slack * a for a in parts]
        base = [-slack * c * total for c in counts]
        due = [slack * (c + 1) - 1 for c in counts]
        drop = slack * total
        out = []
        for p in range(n, n + m):
            best, best_due, best_part = -1, 0, 1
            for i in sources:
                if step[i] * p + base[i] >= total and (
                    best < 0 or due[i] * best_part < best_due * parts[i]
                ):
                    best, best_due, best_part = i, due[i], parts[i]
            if best < 0:  # impossible by Tijdeman's theorem
                raise RuntimeError(f"no source may take position {p}")
            out.append(best)
            base[best] -= drop
            due[best] += slack
        return out

    def picks(self, n: int, counts: Sequence[int], m: int) -> list[int]:
        """:meth:`sequence` as a list."""
        return self.sequence(n, counts, m).tolist()

    def pick(self, n: int, counts: Sequence[int]) -> int:
        """The source of position ``n`` (1-based) of the segment."""
        return self.picks_sequential(n, counts, 1)[0]

    # ------------------------------------------------------------------ blocks
    def sequence(self, n: int, counts: Sequence[int], m: int) -> np.ndarray:
        """The sources of positions ``n .. n + m - 1`` (1-based) of the segment given the counts
        before them, as int64; the same as :meth:`picks_sequential`, computed in blocks."""
        S = len(self.parts)
        out = np.zeros(m, dtype=np.int64)
        if S == 1:
            return out
        counts = np.array(counts, dtype=np.int64)
        done = 0
        while done < m:
            run = self._block(n + done, counts, min(BLOCK, m - done))
            if not len(run):  # nothing decidable from this block: one position exactly
                run = np.array(self.picks_sequential(n + done, counts.tolist(), 1), np.int64)
            out[done : done + len(run)] = run
            counts += np.bincount(run, minlength=S)
            done += len(run)
        return out

    def _block(self, p0: int, counts: np.ndarray, q: int) -> np.ndarray:
        """The sources of up to ``q`` positions from ``p0``: the jobs in deadline order while
        each is released by its position, an earliest-deadline-first queue where one is not."""
        src, rel, cut = self._jobs(p0, counts, q)
        slots = min(q, cut)
        rank = np.arange(slots, dtype=np.int64)  # the job (its deadline rank) at each slot
        late = np.flatnonzero(rel[:slots] > rank)  # not yet released at its rank's slot
        queue = None
        t = 0
        while t < slots:
            v = late[np.searchsorted(late, t)] if late.size and late[-1] >= t else slots
            t = int(v)  # slots before v keep the sorted order
            if t >= slots:
                break
            if queue is None:
                queue = _Queue(rel[:cut], late, slots)
            t, synced = queue.run(rank, t, slots)
            if not synced:
                break
        return src[rank[:t]]

    def _jobs(self, p0: int, counts: np.ndarray, q: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The jobs that may fall among ``q`` positions from ``p0``, in exact deadline order
        (ties: the lower source): their sources, release slots (0: ``p0``), and how many of them
        are certainly complete (no job left out is due before them)."""
        w, s, S = self._w, self.slack, len(self.parts)
        last = p0 + q - 1
        hi = np.floor(w * last).astype(np.int64) + 3  # past any count at `last`, and one more
        n_i = np.maximum(hi - counts, 1)
        src = np.repeat(np.arange(S, dtype=np.int64), n_i)
        k = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(n_i) - n_i, n_i)
        k += counts[src]
        top = int((counts + n_i).max()) + 2
        if hasattr(self, "_lcm_per") and s * top * max(self._lcm, self.total) < _INT64:
            key = (s * (k + 1) - 1) * self._lcm_per[src]
            order = np.lexsort((src, key))
            src, k, key = src[order], k[order], key[order]
            left_out = ((s * (counts + n_i + 1) - 1) * self._lcm_per).min()
            cut = int(np.searchsorted(key, left_out, side="left"))
            num = (k * s + 1) * self.total  # released at ceil(num / den)
            rel = -(-num // (s * self._parts64[src])) - p0
            return src, rel, cut
        key = (k + (1.0 - 1.0 / s)) / w[src]
        order = np.lexsort((src, key))
        src, k, key = src[order], k[order], key[order]
        limit = np.min((counts + n_i + (1.0 - 1.0 / s)) / w) * (1 - 4 * _KEY_TOL)
        cut = int(np.searchsorted(key, limit, side="left"))
        cut = self._exact_order(src, k, key, cut)
        return src, self._release(k, src) - p0, cut

    def _exact_order(self, src: np.ndarray, k: np.ndarray, key: np.ndarray, q: int) -> int:
        """Re-sort in place, in exact integers, every run of the first ``q`` jobs whose float
        deadlines are too close to order (runs of equal weights at equal k are already in
        order); -> ``q``, cut back to the start of a run that continues past it."""
        near = np.flatnonzero(np.diff(key[: q + 1]) <= _KEY_TOL * key[1 : q + 1])  # (j, j + 1)
        if not near.size:
            return q
        starts = near[np.r_[True, np.diff(near) > 1]]
        ends = near[np.r_[np.diff(near) > 1, True]] + 2  # exclusive
        if ends[-1] > q:  # the last run may continue past q
            q = int(starts[-1])
        cls, same_k = self._class[src], np.diff(k) == 0
        plain = (cls[near] == cls[near + 1]) & same_k[near]  # equal deadlines, in order
        s, parts = self.slack, self.parts
        for j in np.unique(np.searchsorted(starts, near[~plain], side="right") - 1).tolist():
            lo, hi = int(starts[j]), int(ends[j])
            if hi > q:
                break
            run = sorted(
                zip(src[lo:hi].tolist(), k[lo:hi].tolist(), strict=True),
                key=lambda job: (Fraction(s * (job[1] + 1) - 1, parts[job[0]]), job[0]),
            )
            src[lo:hi] = [j[0] for j in run]
            k[lo:hi] = [j[1] for j in run]
        return q

    def _release(self, k: np.ndarray, src: np.ndarray) -> np.ndarray:
        """The first position at which each job (source ``src``, number ``k``) is released:
        ``ceil((k + 1/s) / w)``; in exact integers wherever the float is near an integer."""
        s = self.slack
        x = (k + 1.0 / s) / self._w[src]
        rel = np.ceil(x).astype(np.int64)
        unsure = np.flatnonzero(np.abs(x - np.rint(x)) <= 1e-9 + 1e-15 * x)
        total, parts = self.total, self.parts
        for j in unsure.tolist():
            rel[j] = -(-total * (int(k[j]) * s + 1) // (s * parts[int(src[j])]))
        return rel


class _Queue:
    """Earliest deadline first over the jobs of a block, where the sorted order does not hold:
    jobs enter as they are released (``rel``: release slot per deadline rank), the lowest rank
    leaves at each slot."""

    def __init__(self, rel: np.ndarray, late: np.ndarray, slots: int) -> None:
        self.rel = rel
        by_release = np.argsort(rel, kind="stable")
        self.by_release, self.released = by_release.tolist(), rel[by_release].tolist()
        ahead = np.arange(len(rel)) - rel  # how far before its rank's slot a job is released
        self.reach = max(0, int(ahead.max())) if len(rel) else 0
        # per slot u: how many slots from u the sorted order holds (up to the next late job)
        at = np.arange(slots + 1)
        nxt = np.append(late, slots)[np.searchsorted(late, at)]
        self.holds = (np.minimum(nxt, slots) - at).tolist()

    def run(self, rank: np.ndarray, t: int, slots: int) -> tuple[int, bool]:
        """Fill slots from ``t`` (every rank below ``t`` placed before it) until the ranks
        placed are again exactly ``0 .. u - 1`` with the sorted order holding for a while
        after ``u`` -> ``(u, True)``; or up to ``slots``, or until no job of the block is
        released -> ``(u, False)``."""
        n = len(self.released)
        heap = (t + np.flatnonzero(self.rel[t : t + self.reach + 1] <= t)).tolist()
        heapq.heapify(heap)
        ptr = bisect.bisect_right(self.released, t)
        order, released, holds = self.by_release, self.released, self.holds
        push, pop = heapq.heappush, heapq.heappop
        placed: list[int] = []
        top, u, synced = t - 1, t, False
        while u < slots:
            while ptr < n and released[ptr] <= u:
                push(heap, order[ptr])
                ptr += 1
            if not heap:
                break
            j = pop(heap)
            placed.append(j)
            if j > top:
                top = j
            u += 1
            if top == u - 1 and holds[u] >= _LONG_RUN:  # ranks 0 .. u - 1 placed
                synced = True
                break
        rank[t:u] = placed
        return u, synced
