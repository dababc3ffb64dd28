"""Lowest-peak topological orders: a portfolio of list schedulers and an exact search.

Design notes
------------
* A :class:`Problem` is the memory model of one graph (:mod:`savedhooks.memory`)
  reduced to integers: per node the bytes it allocates, per buffer its size and
  the nodes that touch it (make or read it through any alias), and the order
  constraints (data dependencies plus those the caller adds for in-place writes,
  RNG and side effects). A buffer is freed after the last node touching it, as in
  :func:`savedhooks.memory.simulate_order`; inputs count from the start.
* Strategies share one signature, ``strategy(problem) -> order``, as inductor's
  ``memory.py``: input order, least peak memory first, BFS, DFS and bytes-freed
  list scheduling. Each is scored raw and after the hook placement post-pass
  (:func:`place`); :func:`schedule` keeps the lowest modelled peak, the input
  order winning ties, so the result is never worse than the input.
* The exact search is best-first over scheduled sets (the live bytes after a set
  of nodes do not depend on their order, so one entry per set is enough), costs
  being the peak so far. Two safe rules keep it small: a set reached again at a
  higher peak is dropped, and a ready node that frees at least what it allocates
  without passing the peak so far is taken alone (some optimal completion starts
  with it). It stops at a state budget and then reports the gap to the best lower
  bound known instead of "optimal".
* Everything is deterministic: ties break on the input order.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
from collections.abc import Callable, Iterable

__all__ = [
    "STRATEGIES",
    "Problem",
    "Schedule",
    "SearchResult",
    "beam",
    "bfs",
    "build_problem",
    "bytes_freed",
    "check_order",
    "dfs",
    "exact_search",
    "input_order",
    "lpmf",
    "peak_of",
    "place",
    "schedule",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One graph's scheduling problem.

    Attributes:
        preds: per node, the nodes that must run before it.
        fixed: nodes that run first, in this order (placeholders: the signature).
        alloc: per node, bytes it allocates.
        sizes: per buffer, bytes.
        touchers: per buffer, the nodes that make or read it (it is freed after the last).
        freeable: per buffer, whether it may be freed (not an output, not a kept input).
        base: bytes live before the first node (the inputs).
        early: nodes used only by outputs or by other such nodes (pack chains).
        late: nodes computed only from fixed nodes or other such nodes (unpack chains).
        scratch: per node, bytes it allocates and frees while it runs (empty: none).
    """

    preds: tuple[tuple[int, ...], ...]
    fixed: tuple[int, ...]
    alloc: tuple[int, ...]
    sizes: tuple[int, ...]
    touchers: tuple[tuple[int, ...], ...]
    freeable: tuple[bool, ...]
    base: int
    early: frozenset[int]
    late: frozenset[int]
    scratch: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.preds)
        if len(self.alloc) != n or not (len(self.sizes) == len(self.touchers) == len(self.freeable)):
            raise ValueError("Problem: per-node and per-buffer tables must have matching lengths")
        if self.scratch and len(self.scratch) != n:
            raise ValueError("Problem: scratch must have one entry per node")
        if any(not 0 <= p < n for ps in self.preds for p in ps):
            raise ValueError("Problem: a predecessor index is out of range")

    @property
    def size(self) -> int:
        """Number of nodes."""
        return len(self.preds)

    @functools.cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the nodes that must run after it."""
        out: list[list[int]] = [[] for _ in self.preds]
        for v, ps in enumerate(self.preds):
            for p in ps:
                out[p].append(v)
        return tuple(tuple(s) for s in out)

    @functools.cached_property
    def peak_alloc(self) -> tuple[int, ...]:
        """Per node, what it adds to the live bytes while it runs: its outputs plus its scratch."""
        return tuple(a + (self.scratch[v] if self.scratch else 0) for v, a in enumerate(self.alloc))

    @functools.cached_property
    def descendants(self) -> tuple[int, ...]:
        """Per node, a bitset (int) of the nodes that depend on it."""
        out = [0] * self.size
        for v in reversed(_topological(self)):
            for succ in self.succs[v]:
                out[v] |= out[succ] | (1 << succ)
        return tuple(out)

    @functools.cached_property
    def touched(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the buffers it makes or reads."""
        out: list[list[int]] = [[] for _ in self.preds]
        for b, nodes in enumerate(self.touchers):
            for v in nodes:
                out[v].append(b)
        return tuple(tuple(t) for t in out)


def _topological(problem: Problem) -> list[int]:
    waiting = [len(ps) for ps in problem.preds]
    ready = [v for v in range(problem.size) if not waiting[v]]
    order = []
    while ready:
        v = ready.pop()
        order.append(v)
        for succ in problem.succs[v]:
            waiting[succ] -= 1
            if not waiting[succ]:
                ready.append(succ)
    if len(order) != problem.size:
        raise ValueError("the problem's constraints have a cycle")
    return order


def build_problem(memory, device, extra_edges: Iterable[tuple[int, int]] = (), fixed: Iterable[int] = ()) -> Problem:
    """Reduce a graph's memory model to a :class:`Problem`.

    Args:
        memory: a :class:`savedhooks.memory.GraphMemory`.
        device: count only buffers on this device.
        extra_edges: ``(before, after)`` node pairs to keep in order beyond the data
            dependencies (in-place writes, RNG, side effects).
        fixed: nodes that stay first, in this order (placeholders).

    Returns:
        The problem; node ``i`` is ``memory.node_names[i]``.

    Raises:
        ValueError: an edge names a node out of range.
    """
    n = len(memory.node_names)
    preds = [set(d) for d in memory.inputs]
    for a, b in extra_edges:
        if not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"edge {(a, b)} names a node out of range")
        if a != b:
            preds[b].add(a)
    on_device = [b.device == device for b in memory.buffers]
    alloc = [
        sum(memory.buffers[b].nbytes for b in made if on_device[b] and not memory.buffers[b].is_input)
        for made in memory.allocs
    ]
    touchers: list[set[int]] = [set() for _ in memory.buffers]
    for v, (made, read) in enumerate(zip(memory.allocs, memory.reads)):
        for b in (*made, *read):
            touchers[b].add(v)
    kept = [b for b in range(len(memory.buffers)) if on_device[b]]
    fixed = tuple(fixed)
    users: list[set[int]] = [set() for _ in range(n)]
    for v, ps in enumerate(preds):
        for p in ps:
            users[p].add(v)
    is_fixed = set(fixed)
    early: set[int] = set()
    for v in range(n - 1, -1, -1):
        if v not in is_fixed and all(u in early for u in users[v]):
            early.add(v)
    late: set[int] = set()
    for v in range(n):
        if v not in is_fixed and preds[v] and all(p in is_fixed or p in late for p in preds[v]):
            late.add(v)
    return Problem(
        preds=tuple(tuple(sorted(p)) for p in preds),
        fixed=fixed,
        alloc=tuple(alloc),
        sizes=tuple(memory.buffers[b].nbytes for b in kept),
        touchers=tuple(tuple(sorted(touchers[b])) for b in kept),
        freeable=tuple(memory.buffers[b].freeable for b in kept),
        base=sum(memory.buffers[b].nbytes for b in kept if memory.buffers[b].is_input),
        early=frozenset(early),
        late=frozenset(late),
        scratch=tuple(memory.scratch_on(v, device) for v in range(n)),
    )


def peak_of(problem: Problem, order: list[int]) -> int:
    """Modelled peak bytes of running ``problem`` in ``order`` (alloc, run, free).

    Args:
        problem: the problem.
        order: a permutation of its nodes.

    Returns:
        The peak; equal to :func:`savedhooks.memory.simulate_order` on the same graph.

    Raises:
        ValueError: ``order`` is not a topological order of ``problem``.
    """
    check_order(problem, order)
    position = {v: i for i, v in enumerate(order)}
    frees = [0] * len(order)
    for b, nodes in enumerate(problem.touchers):
        if problem.freeable[b] and nodes:
            frees[max(position[v] for v in nodes)] += problem.sizes[b]
    live = peak = problem.base
    for i, v in enumerate(order):
        peak = max(peak, live + problem.peak_alloc[v])
        live += problem.alloc[v] - frees[i]
    return peak


def check_order(problem: Problem, order: list[int]) -> None:
    """Check that ``order`` is a topological order starting with the fixed nodes.

    Args:
        problem: the problem.
        order: the order to check.

    Returns:
        None.

    Raises:
        ValueError: ``order`` is not a permutation, does not start with the fixed
            nodes, or runs a node before one of its predecessors.
    """
    if sorted(order) != list(range(problem.size)):
        raise ValueError("order must be a permutation of the problem's nodes")
    if tuple(order[: len(problem.fixed)]) != problem.fixed:
        raise ValueError("order must start with the fixed nodes, in their order")
    position = {v: i for i, v in enumerate(order)}
    for v, ps in enumerate(problem.preds):
        if any(position[p] > position[v] for p in ps):
            raise ValueError(f"order runs node {v} before one of its predecessors")


# --- list scheduling --------------------------------------------------------------------------


_STRATEGY_DOC = """

    Args:
        problem: the problem.

    Returns:
        A topological order starting with ``problem.fixed``.

    Raises:
        ValueError: the constraints have a cycle.
"""


def _strategy(fn: Callable[[Problem], list[int]]) -> Callable[[Problem], list[int]]:
    """Give a strategy the shared Args/Returns/Raises of every strategy's docstring."""
    fn.__doc__ = (fn.__doc__ or "").rstrip() + _STRATEGY_DOC
    return fn


def _list_schedule(problem: Problem, key: Callable[[int, int], tuple]) -> list[int]:
    """Schedule the ready node with the smallest ``key(node, bytes it would free now)``.

    Keys are refreshed lazily: a node's free-now bytes only grow, when it becomes
    the last remaining toucher of a buffer.
    """
    n = problem.size
    waiting = [len(ps) for ps in problem.preds]
    remaining = [len(t) for t in problem.touchers]
    free_now = [0] * n
    for b, nodes in enumerate(problem.touchers):
        if problem.freeable[b] and len(nodes) == 1:
            free_now[nodes[0]] += problem.sizes[b]
    done = [False] * n
    order: list[int] = []
    heap: list[tuple] = []

    def run(v: int) -> None:
        done[v] = True
        order.append(v)
        for b in problem.touched[v]:
            remaining[b] -= 1
            if remaining[b] == 1 and problem.freeable[b]:
                last = next(u for u in problem.touchers[b] if not done[u])
                free_now[last] += problem.sizes[b]
                if waiting[last] == 0:
                    heapq.heappush(heap, (key(last, free_now[last]), last, free_now[last]))
        for s in problem.succs[v]:
            waiting[s] -= 1
            if waiting[s] == 0 and s not in fixed:
                heapq.heappush(heap, (key(s, free_now[s]), s, free_now[s]))

    fixed = set(problem.fixed)
    for v in problem.fixed:
        run(v)
    for v in range(n):
        if waiting[v] == 0 and not done[v] and v not in fixed:
            heapq.heappush(heap, (key(v, free_now[v]), v, free_now[v]))
    while heap:
        _, v, stamp = heapq.heappop(heap)
        if done[v] or stamp != free_now[v]:  # stale entry: a fresher one is queued
            continue
        run(v)
    if len(order) != n:
        raise ValueError("the problem's constraints have a cycle")
    return order


@_strategy
def input_order(problem: Problem) -> list[int]:
    """The graph's own order (fixed nodes first).
"""
    return _list_schedule(problem, lambda v, freed: (v,))


@_strategy
def lpmf(problem: Problem) -> list[int]:
    """Least peak memory first: the ready node that allocates least, then frees most.
"""
    return _list_schedule(problem, lambda v, freed: (problem.peak_alloc[v], -freed, v))


@_strategy
def bytes_freed(problem: Problem) -> list[int]:
    """Bytes-freed list scheduling: the ready node with the lowest net allocation.
"""
    return _list_schedule(problem, lambda v, freed: (problem.alloc[v] - freed, problem.peak_alloc[v], v))


@_strategy
def bfs(problem: Problem) -> list[int]:
    """Breadth first: by depth (longest path from a source), then input order.
"""
    depth = [0] * problem.size
    for v in input_order(problem):
        depth[v] = max((depth[p] + 1 for p in problem.preds[v]), default=0)
    return _list_schedule(problem, lambda v, freed: (depth[v], v))


@_strategy
def dfs(problem: Problem) -> list[int]:
    """Depth first from the sinks: each node right after its unscheduled ancestors, largest branch first.
"""
    done = set(problem.fixed)
    order = list(problem.fixed)
    sinks = [v for v in range(problem.size) if not problem.succs[v]]
    for sink in sinks:
        stack = [(sink, False)]
        while stack:
            v, expanded = stack.pop()
            if v in done:
                continue
            if expanded:
                done.add(v)
                order.append(v)
                continue
            stack.append((v, True))
            # pushed last runs first: the predecessor allocating most goes first
            for p in sorted(problem.preds[v], key=lambda p: (problem.alloc[p], -p)):
                if p not in done:
                    stack.append((p, False))
    return order




# --- hook placement post-pass -----------------------------------------------------------------


def place(problem: Problem, order: list[int]) -> list[int]:
    """Move pack chains up to their inputs' last use, and unpack chains down to their first user.

    ``problem.early`` nodes (leading only to outputs) go right after the last node,
    other than their own descendants, that touches a buffer they read: a packed
    tensor dies at its pack. ``problem.late`` nodes (computed only from inputs) go
    right before their first user (but not past another reader of their inputs):
    an unpacked tensor is born when needed. Other
    nodes keep their relative order. On a forward graph whose every node leads to
    the outputs, compute nodes stay put: their inputs' last use is after them.

    Args:
        problem: the problem.
        order: a topological order of it.

    Returns:
        The new order.

    Raises:
        Nothing.
    """
    descendants = problem.descendants

    def last_use(v: int) -> list[int]:
        uses = [u for b in problem.touched[v] for u in problem.touchers[b] if u != v and not descendants[v] >> u & 1]
        return list(problem.preds[v]) + uses

    order = _hoist(order, problem.early, last_use, floor=len(problem.fixed) - 1)
    # The mirror image: in the reversed order a late node rises to right after its
    # first user, but never past another node touching what it reads (which would
    # keep that alive longer).
    position = {v: i for i, v in enumerate(order)}

    def first_use(v: int) -> list[int]:
        later = [u for b in problem.touched[v] for u in problem.touchers[b] if position[u] > position[v]]
        return list(problem.succs[v]) + later

    return _hoist(order[::-1], problem.late, first_use, floor=None)[::-1]


def _hoist(order: list[int], movers: frozenset[int], anchors, floor: int | None) -> list[int]:
    """Move each mover up to right after the latest of its anchors (never above position ``floor``).

    Sort keys are tuples: a staying node is ``(position,)``; a moved one is its
    anchor's key plus ``(k,)``, which sorts after the anchor and before the next
    staying node, ``k`` keeping moved nodes in their relative order (a chain's
    links follow each other).
    """
    key: dict[int, tuple[int, ...]] = {v: (i,) for i, v in enumerate(order)}
    for k, v in enumerate(order):
        if v in movers:
            anchor = max([key[u] for u in anchors(v)] + ([] if floor is None else [(floor,)]), default=None)
            if anchor is not None and anchor < key[v]:
                key[v] = anchor + (k,)
    return sorted(order, key=key.__getitem__)


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

    def _free(self, state: int, v: int) -> bool:
        return not self.pred_mask[v] & ~state

    def __call__(self, state: int, live: int, peak: int, ready: tuple[int, ...]) -> list[tuple]:
        """``(node, child state, child peak, child live, child ready)`` per move worth trying."""
        problem, moves = self.problem, []
        for v in ready:
            child = state | (1 << v)
            freed = sum(
                problem.sizes[b]
                for b in problem.touched[v]
                if problem.freeable[b] and self.touch_mask[b] & ~child == 0
            )
            during = live + problem.peak_alloc[v]
            newly = tuple(s for s in problem.succs[v] if self._free(child, s))
            move = (v, child, max(peak, during), live + problem.alloc[v] - freed, tuple(u for u in ready if u != v) + newly)
            if problem.alloc[v] <= freed and during <= peak:  # safe: some optimal completion starts here
                return [move]
            moves.append(move)
        return moves


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

    Raises:
        Nothing.
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
        for v, child, child_peak, child_live, child_ready in moves(state, live, peak, ready):
            if child_peak >= incumbent or best.get(child, incumbent) <= child_peak:
                continue
            best[child] = child_peak
            parent[child] = (state, v)
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

    Raises:
        Nothing.
    """
    width = width or max(4, min(64, 40_000 // max(problem.size, 1)))
    moves = _Moves(problem)
    # partial orders as linked cells (node, previous cell): extending one costs O(1)
    states = {moves.start: (moves.peak0, moves.live0, moves.ready0, None)}
    for _ in range(problem.size - len(problem.fixed)):
        children: dict[int, tuple] = {}
        for state, (peak, live, ready, cell) in states.items():
            for v, child, child_peak, child_live, child_ready in moves(state, live, peak, ready):
                if child not in children or (child_peak, child_live) < children[child][:2]:
                    children[child] = (child_peak, child_live, child_ready, (v, cell))
        states = dict(sorted(children.items(), key=lambda item: (item[1][0], item[1][1], item[0]))[:width])
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


STRATEGIES: dict[str, Callable[[Problem], list[int]]] = {
    "input": input_order,
    "lpmf": lpmf,
    "bfs": bfs,
    "dfs": dfs,
    "bytes_freed": bytes_freed,
    "beam": beam,
}


# --- the driver -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The chosen order and how every method scored.

    Attributes:
        order: the chosen order (node indices).
        peak: its modelled peak in bytes.
        method: the method that found it (``"input"`` when nothing was lower).
        scores: modelled peak per method tried (``name`` raw, ``name+place`` placed).
        input_peak: the input order's peak.
        lower_bound: the best lower bound known on any order's peak.
        optimal: whether ``peak`` is proven optimal.
    """

    order: list[int]
    peak: int
    method: str
    scores: dict[str, int]
    input_peak: int
    lower_bound: int
    optimal: bool

    @property
    def gap(self) -> float:
        """Relative distance of ``peak`` above ``lower_bound`` (0.0 when optimal)."""
        return 0.0 if self.optimal or not self.peak else (self.peak - self.lower_bound) / self.peak


def schedule(
    problem: Problem,
    lower_bound: int = 0,
    strategies: Iterable[str] = tuple(STRATEGIES),
    exact_budget: int = 20_000,
    exact_max_nodes: int = 2_000,
) -> Schedule:
    """Try every strategy (raw and placed), then the exact search; keep the lowest peak.

    Args:
        problem: the problem.
        lower_bound: a peak no order can go below (e.g.
            :func:`savedhooks.memory.lower_bound`); reaching it proves optimality.
        strategies: names from :data:`STRATEGIES`; ``"input"`` is always tried first.
        exact_budget: state budget of :func:`exact_search` (0 to skip it).
        exact_max_nodes: skip the exact search above this many nodes.

    Returns:
        A :class:`Schedule`; its peak is never above the input order's.

    Raises:
        ValueError: an unknown strategy name.
    """
    names = ["input"] + [s for s in strategies if s != "input"]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
    scores: dict[str, int] = {}
    best_name, best_order, best_peak = "", [], None
    for name in names:
        raw = STRATEGIES[name](problem)
        for label, order in ((name, raw), (name + "+place", place(problem, raw))):
            peak = peak_of(problem, order)
            scores[label] = peak
            if best_peak is None or peak < best_peak:
                best_name, best_order, best_peak = label, order, peak
    input_peak = scores["input"]
    bound = min(lower_bound, best_peak)
    optimal = best_peak <= lower_bound
    if not optimal and exact_budget and problem.size <= exact_max_nodes:
        found = exact_search(problem, best_peak, exact_budget)
        if found.order is not None:
            best_name, best_order, best_peak = "exact", found.order, found.peak
            scores["exact"] = found.peak
        optimal = found.optimal
        bound = best_peak if optimal else max(bound, found.lower_bound)
    log.info(
        "savedhooks schedule: %d nodes, input %d B, best %d B by %s (%s); scores %s",
        problem.size, input_peak, best_peak, best_name,
        "optimal" if optimal else f"lower bound {bound} B", scores,
    )
    return Schedule(best_order, best_peak, best_name, scores, input_peak, bound, optimal)
