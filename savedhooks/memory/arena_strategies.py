"""Arena strategies: an offset per buffer from sizes and lifetimes (see :mod:`savedhooks.memory.arena`).

Every strategy has one signature, ``strategy(sizes, starts, ends) -> offsets``:
per buffer its size (already aligned), and the first and last positions it is
alive at (closed range). Buffers of size 0 are ignored and put at 0.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence

__all__ = ["ARENA_STRATEGIES", "greedy_by_breadth", "greedy_by_size", "iterated_greedy", "linear_scan"]


# --- strategies -----------------------------------------------------------------------------------


class _OverlapIndex:
    """Placed buffers, found by overlap of their lifetimes with a query range.

    Short lifetimes are kept by start, in classes of length ``[2^(k-1), 2^k)``:
    in class ``k`` a lifetime overlapping ``[s, e]`` starts in ``[s - 2^k + 2, e]``,
    one bisect away. Long ones (:data:`_LONG` positions or more: outputs, saved
    activations) overlap most queries: they are kept as ``(offset, top, start,
    end)`` sorted by offset, so that the overlapping ones come out sorted.
    """

    def __init__(self, starts: Sequence[int], ends: Sequence[int]) -> None:
        self.starts, self.ends = starts, ends
        self.classes: dict[int, tuple[list[int], list[int]]] = {}
        self.long: list[tuple[int, int, int, int]] = []

    def add(self, i: int, offset: int, top: int) -> None:
        s, e = self.starts[i], self.ends[i]
        if e - s + 1 >= _LONG:
            bisect.insort(self.long, (offset, top, s, e))
            return
        keys, ids = self.classes.setdefault((e - s + 1).bit_length(), ([], []))
        at = bisect.bisect_right(keys, s)
        keys.insert(at, s)
        ids.insert(at, i)

    def short(self, s: int, e: int) -> list[int]:
        """The short placed lifetimes overlapping ``[s, e]``."""
        ends, out = self.ends, []
        for k, (keys, ids) in self.classes.items():
            lo, mid = bisect.bisect_left(keys, s - (1 << k) + 2), bisect.bisect_left(keys, s)
            out += [j for j in ids[lo:mid] if ends[j] >= s]  # started before s: alive at s?
            out += ids[mid : bisect.bisect_right(keys, e)]  # started in [s, e]: overlapping
        return out


_LONG = 64


def _best_fit(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int], priority: Sequence[int]) -> list[int]:
    """Place buffers in ``priority`` order, each in the smallest gap that fits among those alive with it."""
    offsets = [0] * len(sizes)
    spans: list[tuple[int, int]] = [(0, 0)] * len(sizes)  # (offset, offset + size) once placed
    placed = _OverlapIndex(starts, ends)
    for i in priority:
        size, s, e = sizes[i], starts[i], ends[i]
        if not size:
            continue
        taken = sorted(map(spans.__getitem__, placed.short(s, e)))
        if placed.long:  # two sorted runs: the sort merges them
            taken += [(lo, hi) for lo, hi, a, b in placed.long if a <= e and b >= s]
            taken.sort()
        best_gap, best_at, top = None, 0, 0
        for lo, hi in taken:
            if lo - top >= size and (best_gap is None or lo - top < best_gap):
                best_gap, best_at = lo - top, top
            if hi > top:  # noqa: PLR1730 (not max(): a call per pair is a fifth of the planning time)
                top = hi
        offsets[i] = best_at if best_gap is not None else top
        spans[i] = (offsets[i], offsets[i] + size)
        placed.add(i, *spans[i])
    return offsets


def greedy_by_size(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Greedy by size: largest first (then longest, then earliest), each into the best-fitting gap.

    Args:
        sizes: per buffer, its (aligned) size.
        starts: per buffer, the first position it is alive at.
        ends: per buffer, the last position it is alive at.

    Returns:
        Per buffer, its offset.
    """
    priority = sorted(range(len(sizes)), key=lambda i: (-sizes[i], starts[i] - ends[i], starts[i], i))
    return _best_fit(sizes, starts, ends, priority)


def greedy_by_breadth(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Greedy by breadth: buffers by the widest position of their lifetime, then by size; best-fitting gap.

    A position's breadth is the bytes alive there. Positions are visited widest
    first (earliest on ties); each visit places its not yet placed buffers,
    largest first. A buffer is therefore placed at the widest position in its
    lifetime, found with a sparse table of range maxima.

    Args:
        sizes: per buffer, its (aligned) size.
        starts: per buffer, the first position it is alive at.
        ends: per buffer, the last position it is alive at.

    Returns:
        Per buffer, its offset.
    """
    if not sizes:
        return []
    delta = [0] * (max(ends) + 2)
    for size, s, e in zip(sizes, starts, ends):
        delta[s] += size
        delta[e + 1] -= size
    live, keys = 0, []  # (-breadth, position): the smallest key is the widest position, earliest on ties
    for p in range(len(delta) - 1):
        live += delta[p]
        keys.append((-live, p))
    table = [keys]
    while 1 << len(table) <= len(keys):
        half, prev = 1 << (len(table) - 1), table[-1]
        table.append([min(prev[p], prev[p + half]) for p in range(len(prev) - half)])

    def widest(s: int, e: int) -> tuple[int, int]:
        level = (e - s + 1).bit_length() - 1
        return min(table[level][s], table[level][e - (1 << level) + 1])

    priority = sorted(range(len(sizes)), key=lambda i: (widest(starts[i], ends[i]), -sizes[i], i))
    return _best_fit(sizes, starts, ends, priority)


def linear_scan(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Linear scan: positions in order; dead buffers free their blocks, new ones take the best-fitting block.

    Free blocks are kept sorted and coalesced; a free block reaching the top of
    the arena lowers the top instead. A buffer that fits no free block goes at
    the top. Buffers born at one position are placed largest first.

    Args:
        sizes: per buffer, its (aligned) size.
        starts: per buffer, the first position it is alive at.
        ends: per buffer, the last position it is alive at.

    Returns:
        Per buffer, its offset.
    """
    offsets = [0] * len(sizes)
    free_at: list[int] = []  # free blocks below the top, by offset
    free_size: list[int] = []
    alive: list[tuple[int, int]] = []  # (end, buffer) heap
    top = 0
    for i in sorted(range(len(sizes)), key=lambda i: (starts[i], -sizes[i], i)):
        if not sizes[i]:
            continue
        while alive and alive[0][0] < starts[i]:
            _, j = heapq.heappop(alive)
            top = _give_back(free_at, free_size, offsets[j], sizes[j], top)
        fits = [k for k, size in enumerate(free_size) if size >= sizes[i]]
        if fits:
            k = min(fits, key=lambda k: (free_size[k], free_at[k]))
            offsets[i] = free_at[k]
            if free_size[k] == sizes[i]:
                del free_at[k], free_size[k]
            else:
                free_at[k] += sizes[i]
                free_size[k] -= sizes[i]
        else:
            offsets[i], top = top, top + sizes[i]
        heapq.heappush(alive, (ends[i], i))
    return offsets


def _give_back(free_at: list[int], free_size: list[int], at: int, size: int, top: int) -> int:
    """Return block ``[at, at + size)`` to the free list, coalescing; returns the new top."""
    k = bisect.bisect_left(free_at, at)
    if k < len(free_at) and at + size == free_at[k]:  # merge with the next block
        size += free_size[k]
        del free_at[k], free_size[k]
    if k and free_at[k - 1] + free_size[k - 1] == at:  # merge with the previous block
        k -= 1
        at, size = free_at[k], free_size[k] + size
        del free_at[k], free_size[k]
    if at + size == top:
        return at
    free_at.insert(k, at)
    free_size.insert(k, size)
    return top


def iterated_greedy(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Iterated greedy: longest lifetime first (then largest), then the buffers that set the arena's height first.

    Round one is TorchScript's greedy by longest and size (best-fitting gap).
    Each further round moves the buffers reaching the top of the last plan to
    the front of the priority and places again ("squeaky wheel"); the smallest
    arena is kept. Rounds: ``min(8, 8000 // buffers)``, at least one, so large
    graphs plan once.

    Args:
        sizes: per buffer, its (aligned) size.
        starts: per buffer, the first position it is alive at.
        ends: per buffer, the last position it is alive at.

    Returns:
        Per buffer, its offset.
    """
    priority = sorted(range(len(sizes)), key=lambda i: (starts[i] - ends[i], -sizes[i], starts[i], i))
    best: tuple[int, list[int]] | None = None
    for _ in range(max(1, min(8, 8000 // max(len(sizes), 1)))):
        offsets = _best_fit(sizes, starts, ends, priority)
        arena = max((o + s for o, s in zip(offsets, sizes)), default=0)
        if best is None or arena < best[0]:
            best = (arena, offsets)
        at_top = [i for i in priority if sizes[i] and offsets[i] + sizes[i] == arena]
        priority = at_top + [i for i in priority if not (sizes[i] and offsets[i] + sizes[i] == arena)]
    return best[1]


# The offset assignments plan_arena(strategy=...) runs, by name ("best" runs them all).
ARENA_STRATEGIES: dict[str, Callable[[Sequence[int], Sequence[int], Sequence[int]], list[int]]] = {
    "greedy_by_size": greedy_by_size,
    "greedy_by_breadth": greedy_by_breadth,
    "linear_scan": linear_scan,
    "iterated_greedy": iterated_greedy,
}
