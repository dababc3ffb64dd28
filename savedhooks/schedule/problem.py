"""One graph's scheduling problem, reduced to integers, and the peak of an order."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

__all__ = ["Problem", "build_problem", "check_order", "live_profile", "peak_of", "stretch_profile"]


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
        inputs: per buffer, whether it exists before the graph runs (a graph
            input, owned by the caller; empty: the buffers a fixed node touches
            first). Only :func:`savedhooks.schedule.arena_of` reads it.
        chains: early nodes known to lead only to packed values (a forward
            graph's inlined pack hooks; empty: unknown). They move up together,
            so they do not hold one another back (:func:`savedhooks.schedule.place`).
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
    inputs: tuple[bool, ...] = ()
    chains: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        n = len(self.preds)
        if len(self.alloc) != n or not (len(self.sizes) == len(self.touchers) == len(self.freeable)):
            raise ValueError("Problem: per-node and per-buffer tables must have matching lengths")
        if self.inputs and len(self.inputs) != len(self.sizes):
            raise ValueError("Problem: inputs must have one entry per buffer")
        if self.scratch and len(self.scratch) != n:
            raise ValueError("Problem: scratch must have one entry per node")
        if any(not 0 <= p < n for ps in self.preds for p in ps):
            raise ValueError("Problem: a predecessor index is out of range")
        if not self.chains <= self.early:
            raise ValueError("Problem: chains must be early nodes")

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


def build_problem(
    memory, device, extra_edges: Iterable[tuple[int, int]] = (), fixed: Iterable[int] = (), chains: Iterable[int] = ()
) -> Problem:
    """Reduce a graph's memory model to a :class:`Problem`.

    Args:
        memory: a :class:`savedhooks.memory.GraphMemory`.
        device: count only buffers on this device.
        extra_edges: ``(before, after)`` node pairs to keep in order beyond the data
            dependencies (in-place writes, RNG, side effects).
        fixed: nodes that stay first, in this order (placeholders).
        chains: nodes that lead only to packed values (pack hooks); those of
            them that are early become :attr:`Problem.chains`.

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
        inputs=tuple(memory.buffers[b].is_input for b in kept),
        chains=frozenset(chains) & frozenset(early),
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
    return max(live_profile(problem, order), default=problem.base)


def live_profile(problem: Problem, order: list[int]) -> list[int]:
    """Modelled live bytes while each node of ``order`` runs (alloc, run, free); the peak is their maximum.

    Args:
        problem: the problem.
        order: a permutation of its nodes.

    Returns:
        One figure per position of ``order``, inputs (``problem.base``) included.

    Raises:
        ValueError: ``order`` is not a topological order of ``problem``.
    """
    check_order(problem, order)
    return stretch_profile(problem, order, 0, {v: i for i, v in enumerate(order)}, problem.base)


def stretch_profile(
    problem: Problem, segment: list[int], start: int, position: dict[int, int], live: int
) -> list[int]:
    """:func:`live_profile` over ``segment``, run from position ``start`` on, the rest of the order unchanged.

    A reordered stretch of an order changes the profile inside it only: the
    nodes before and after it, and so the bytes live when it starts, stay. A
    buffer is freed inside it when its last toucher is there (the touchers
    outside keep ``position``, the order's positions before the change).
    The whole order is the stretch from 0 with ``problem.base`` live
    (:func:`live_profile`); :func:`savedhooks.schedule.hoist_frees` judges its
    moves by the stretch they reorder.

    Args:
        problem: the problem.
        segment: the stretch's nodes in their new order (the same nodes as at
            positions ``start`` to ``start + len(segment) - 1`` before).
        start: the stretch's first position in the order.
        position: each node's position in the order before the change.
        live: the bytes live before the stretch's first node runs.

    Returns:
        The live bytes while each node of ``segment`` runs, as :func:`live_profile` gives them.
    """
    new = {u: start + k for k, u in enumerate(segment)}
    frees = [0] * len(segment)
    seen: set[int] = set()
    for u in segment:
        for b in problem.touched[u]:
            if b in seen or not problem.freeable[b]:
                continue
            seen.add(b)
            last = max(new.get(t, position[t]) for t in problem.touchers[b])
            if last - start < len(segment):  # last >= start: u touches b
                frees[last - start] += problem.sizes[b]
    during = []
    for u, freed in zip(segment, frees):
        during.append(live + problem.peak_alloc[u])
        live += problem.alloc[u] - freed
    return during


def check_order(problem: Problem, order: list[int]) -> None:
    """Check that ``order`` is a topological order starting with the fixed nodes.

    Args:
        problem: the problem.
        order: the order to check.

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
