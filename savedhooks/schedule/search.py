"""Searches over sets of scheduled nodes: the exact best-first search and the beam."""

from __future__ import annotations

import dataclasses
import heapq

from savedhooks.schedule.problem import Problem

__all__ = ["SearchResult", "beam", "exact_search"]


# --- exact search ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What the exact search found.

    Attributes:
        order: an order below the incumbent's peak, or None.
        peak: its peak (the incumbent's when none was found).
        optimal: whether the search finished: ``peak`` is then the optimum.
        lower_bound: no order has a lower peak.
        states: sets of scheduled nodes expanded.
    """

    order: list[int] | None
    peak: int
    optimal: bool
    lower_bound: int
    states: int


class _Moves:
    """Expands a set of scheduled nodes by one node: the search's and the beam's step.

    A state is a bitset of scheduled nodes; its live bytes depend only on the set.
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.pred_mask = [sum(1 << p for p in ps) for ps in problem.preds]
        self.touch_mask = [sum(1 << v for v in nodes) for nodes in problem.touchers]
        self.start = sum(1 << v for v in problem.fixed)
        self.full = (1 << problem.size) - 1
        self.peak0 = problem.base + sum(problem.peak_alloc[v] for v in problem.fixed)
        self.live0 = problem.base + sum(problem.alloc[v] for v in problem.fixed) - sum(
            problem.sizes[b]
            for b, nodes in enumerate(problem.touchers)
            if problem.freeable[b] and nodes and self.touch_mask[b] & ~self.start == 0
        )
        self.ready0 = tuple(v for v in range(problem.size) if not self.start >> v & 1 and self._free(self.start, v))
        # per node: its bit, and (bytes, touchers' mask) of each freeable buffer it touches
        self.bit = [1 << v for v in range(problem.size)]
        self.frees = [
            [(problem.sizes[b], self.touch_mask[b]) for b in problem.touched[v] if problem.freeable[b]]
            for v in range(problem.size)
        ]

    def _free(self, state: int, v: int) -> bool:
        return not self.pred_mask[v] & ~state

    def __call__(self, state: int, live: int, peak: int, ready: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """``(node, child state, child peak, child live)`` per move worth trying.

        The child's ready nodes are left to :meth:`ready_after`: the beam keeps few
        of the children it sees, and building each one's tuple cost it most of its time.
        The beam's inner loop: plain lists and local names.
        """
        alloc, peak_alloc, bit, frees, moves = self.problem.alloc, self.problem.peak_alloc, self.bit, self.frees, []
        for v in ready:
            child = state | bit[v]
            unscheduled = ~child
            freed = 0
            for size, touchers in frees[v]:
                if not touchers & unscheduled:  # v is the buffer's last toucher
                    freed += size
            during = live + peak_alloc[v]
            move = (v, child, max(peak, during), live + alloc[v] - freed)
            if alloc[v] <= freed and during <= peak:  # safe: some optimal completion starts here
                return [move]
            moves.append(move)
        return moves

    def ready_after(self, ready: tuple[int, ...], v: int, child: int) -> tuple[int, ...]:
        """The ready nodes once ``v`` (one of ``ready``) is scheduled, reaching the set ``child``."""
        return tuple(u for u in ready if u != v) + tuple(s for s in self.problem.succs[v] if self._free(child, s))


def exact_search(problem: Problem, incumbent: int, budget: int = 20_000) -> SearchResult:
    """Best-first search for an order with a peak below ``incumbent``.

    Args:
        problem: the problem.
        incumbent: the best peak known (from the portfolio); only lower is searched.
        budget: most sets of scheduled nodes to expand.

    Returns:
        A :class:`SearchResult`: ``order`` is a better order or None; ``optimal``
        whether the search finished (then ``peak`` is the optimum); otherwise
        ``lower_bound`` is the lowest peak still open.
    """
    moves = _Moves(problem)
    best = {moves.start: moves.peak0}
    parent: dict[int, tuple[int, int]] = {}
    heap = [(moves.peak0, 0, moves.start, moves.live0, moves.ready0)]
    expanded = 0
    while heap:
        peak, _, state, live, ready = heapq.heappop(heap)
        if best.get(state, peak) < peak:
            continue
        if state == moves.full:
            return SearchResult(list(problem.fixed) + _path(parent, moves.start, state), peak, True, peak, expanded)
        if expanded >= budget:
            return SearchResult(None, incumbent, False, peak, expanded)
        expanded += 1
        for v, child, child_peak, child_live in moves(state, live, peak, ready):
            if child_peak >= incumbent or best.get(child, incumbent) <= child_peak:
                continue
            best[child] = child_peak
            parent[child] = (state, v)
            child_ready = moves.ready_after(ready, v, child)
            heapq.heappush(heap, (child_peak, -child.bit_count(), child, child_live, child_ready))
    return SearchResult(None, incumbent, True, incumbent, expanded)


def beam(problem: Problem, width: int | None = None) -> list[int]:
    """Beam search: the ``width`` lowest (peak so far, live bytes) partial orders, one node a step.

    Args:
        problem: the problem.
        width: partial orders kept per step; default 64 for small graphs, fewer
            for large ones (about 40,000 / nodes, at least 4) to bound the time.

    Returns:
        A topological order starting with ``problem.fixed``.
    """
    width = width or max(4, min(64, 40_000 // max(problem.size, 1)))
    moves = _Moves(problem)
    # partial orders as linked cells (node, previous cell): extending one costs O(1)
    states = {moves.start: (moves.peak0, moves.live0, moves.ready0, None)}
    for _ in range(problem.size - len(problem.fixed)):
        children: dict[int, tuple] = {}  # child -> (peak, live, parent's ready, node, parent's cell)
        for state, (peak, live, ready, cell) in states.items():
            for v, child, child_peak, child_live in moves(state, live, peak, ready):
                if child not in children or (child_peak, child_live) < children[child][:2]:
                    children[child] = (child_peak, child_live, ready, v, cell)
        kept = sorted(children.items(), key=lambda item: (item[1][0], item[1][1], item[0]))[:width]
        states = {
            child: (child_peak, child_live, moves.ready_after(ready, v, child), (v, cell))
            for child, (child_peak, child_live, ready, v, cell) in kept
        }
    _, (_, _, _, cell) = min(states.items(), key=lambda item: (item[1][0], item[0]))
    tail = []
    while cell is not None:
        v, cell = cell
        tail.append(v)
    return list(problem.fixed) + tail[::-1]


def _path(parent: dict[int, tuple[int, int]], start: int, state: int) -> list[int]:
    order = []
    while state != start:
        state, v = parent[state]
        order.append(v)
    return order[::-1]
