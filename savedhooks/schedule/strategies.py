"""List-scheduling strategies (one signature: ``strategy(problem) -> order``) and hook placement."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from savedhooks.schedule.problem import Problem, live_profile, stretch_profile

__all__ = ["bfs", "bytes_freed", "dfs", "dfs_smallest", "hoist_frees", "input_order", "lpmf", "place", "sink_free"]


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
    return _list_schedule(problem, lambda v, _freed: (v,))


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
    return _list_schedule(problem, lambda v, _freed: (depth[v], v))


@_strategy
def dfs(problem: Problem) -> list[int]:
    """Depth first from the sinks: each node right after its unscheduled ancestors, largest branch first.
"""
    sinks = [v for v in range(problem.size) if not problem.succs[v]]
    return _depth_first(problem, sinks, lambda p: (-problem.alloc[p], p))  # the predecessor allocating most first


@_strategy
def dfs_smallest(problem: Problem) -> list[int]:
    """Depth first by size, after inductor's ``topological_sort_dfs``: smallest nodes first, each after its ancestors.

    Nodes are visited from the smallest, and each one's unscheduled
    predecessors before it, the smallest first, recursively. Unlike :func:`dfs`,
    which starts from the sinks and follows the largest branch, this runs what
    is cheap to hold early and large producers only when something small needs
    them. A node's size is the bytes of the buffers it reads plus twice those it
    makes: what it makes stays alive after it, what it reads may die there.
    Inductor's own sort counts what it makes once; on gpt2-big's backward at
    batch 1 this weight models a lower peak than inductor's and than every
    other strategy, :func:`dfs` included (``tests/memory/test_schedule.py``
    checks it on the recorded problem).
"""
    size = [made + sum(problem.sizes[b] for b in touched) for made, touched in zip(problem.alloc, problem.touched)]

    def smallest_first(v: int) -> tuple[int, int]:
        return size[v], v

    return _depth_first(problem, sorted(range(problem.size), key=smallest_first), smallest_first)


def _depth_first(problem: Problem, roots: list[int], first: Callable[[int], tuple[int, int]]) -> list[int]:
    """The fixed nodes, then each root in turn after its unscheduled ancestors; predecessors by ascending ``first``."""
    done = set(problem.fixed)
    order = list(problem.fixed)
    for root in roots:  # pushed last runs first
        _after_predecessors(root, lambda v: sorted(problem.preds[v], key=first, reverse=True), done, order)
    return order


# --- hook placement post-pass -----------------------------------------------------------------


def place(problem: Problem, order: list[int]) -> list[int]:
    """Move pack chains up to their inputs' last use, and unpack chains down to their first user.

    ``problem.early`` nodes (leading only to outputs) go right after the last node,
    other than their own descendants, that touches a buffer they read: a packed
    tensor dies at its pack. For a node of ``problem.chains`` (known to lead
    only to packed values) the other chain nodes do not count: the links of a
    pack chain read the tensor side by side (a bitcast view and ``abs`` of it
    in the fp8 pack) and, each held back by the others, none moved. ``problem.late`` nodes (computed only from inputs) go
    right before their first user (but not past another reader of their inputs):
    an unpacked tensor is born when needed. Other
    nodes keep their relative order. On a forward graph whose every node leads to
    the outputs, compute nodes stay put: their inputs' last use is after them.

    Args:
        problem: the problem.
        order: a topological order of it.

    Returns:
        The new order.
    """
    descendants, chains = problem.descendants, problem.chains

    def last_use(v: int) -> list[int]:
        # the links of one pack chain often read the packed tensor side by side (the fp8 pack's bitcast
        # view and abs of it): anchored to one another, none would move; they all move up, so skip them
        skip = chains if v in chains else ()
        uses = [u for b in problem.touched[v] for u in problem.touchers[b]
                if u != v and u not in skip and not descendants[v] >> u & 1]
        return list(problem.preds[v]) + uses

    order = _hoist(order, problem.early, last_use, floor=len(problem.fixed) - 1, first=chains)
    # The mirror image: in the reversed order a late node rises to right after its
    # first user, but never past another node touching what it reads (which would
    # keep that alive longer).
    position = {v: i for i, v in enumerate(order)}

    def first_use(v: int) -> list[int]:
        later = [u for b in problem.touched[v] for u in problem.touchers[b] if position[u] > position[v]]
        return list(problem.succs[v]) + later

    return _hoist(order[::-1], problem.late, first_use, floor=None)[::-1]


def sink_free(problem: Problem, order: list[int]) -> list[int]:
    """Move every node that allocates nothing down to right before the first node that must follow it.

    In a graph modelled as inductor runs it (``fused=True``), a pointwise node
    computed inside its consumers allocates nothing, so the modelled peak does
    not depend on where it sits, and a search may leave it anywhere. Inductor
    does not always inline it: it stores a pointwise expression that grows too
    large (``realize_opcount_threshold``) or that several nodes read, and a
    fused kernel runs at the place of its earliest node. Four GELU-derivative
    factors of dequantized activations, left at the start of a 4-layer MLP's
    backward, are each stored there (a full-size buffer until their use), well
    above inductor's own peak. Sunk to their consumers, they cost nothing where
    stored. Views and ``getitem`` nodes move too. Placeholders stay; order
    constraints (``problem.preds``, which hold in-place writes and side
    effects) are kept, so the result is topological when ``order`` is.

    Args:
        problem: the problem.
        order: a topological order of it.

    Returns:
        The new order: the other nodes in their relative order, each preceded by
        the nodes that allocate nothing and that it is the first to need.
    """
    fixed = set(problem.fixed)
    free = {v for v in order if problem.peak_alloc[v] == 0 and v not in fixed}
    position = {v: i for i, v in enumerate(order)}
    out: list[int] = []
    done: set[int] = set()

    def waiting(v: int) -> list[int]:  # pending free predecessors, the earliest pushed last (it runs first)
        return sorted((p for p in problem.preds[v] if p in free), key=position.__getitem__, reverse=True)

    for v in order:
        if v not in free:
            _after_predecessors(v, waiting, done, out)
    for v in order:  # free nodes that nothing follows
        _after_predecessors(v, waiting, done, out)
    return out


def hoist_frees(problem: Problem, order: list[int], min_gain: float = 0.0) -> list[int]:
    """Move each node that frees more than it allocates up to just after the other users of what it frees.

    A search judged by the peak alone leaves the rest of the profile as it comes:
    in GPT-2's backward (loss compiled with the model, tied embeddings) the
    output head's weight gradient, a matmul reading the logits gradient, can
    run last, so that gradient stays alive through every layer's backward,
    though the modelled peak sits elsewhere. The model is not exact, and the
    measured peak can move to where that waste is. So, after the search: for each
    node, in order, that is the last to touch buffers larger than what it
    allocates, it moves with those of its ancestors that run after the largest
    such buffer's last other user (ancestors excluded) to right after that user.
    A move is kept when the modelled peak does not rise and the sum of the live
    bytes over the order (the profile's area) falls: only frees come sooner.
    Every node that frees more than it allocates may move (``min_gain`` 0).
    A threshold (``min_gain=1/16`` of the modelled peak) refuses moves that
    gpt2-big needs at batch 8 with its loss compiled, and raises its measured
    peak there.

    Args:
        problem: the problem.
        order: a topological order of it.
        min_gain: the least net bytes a moved node frees, as a fraction of the
            modelled peak (0, the default: every node that frees more than it
            allocates).

    Returns:
        A topological order with a peak no higher and an area no larger.

    Raises:
        ValueError: ``order`` is not a topological order of ``problem``.
    """
    profile = live_profile(problem, order)
    peak = max(profile, default=problem.base)
    floor, descendants = len(problem.fixed) - 1, problem.descendants
    position = {u: i for i, u in enumerate(order)}
    for v in list(order):
        here = position[v]
        freed = [b for b in problem.touched[v]
                 if problem.freeable[b] and max(position[u] for u in problem.touchers[b]) == here]  # fmt: skip
        gain = sum(problem.sizes[b] for b in freed) - problem.alloc[v]
        if here <= floor or gain <= 0 or gain < peak * min_gain:
            continue
        largest = max(freed, key=problem.sizes.__getitem__)  # v and its ancestors (descendants bits) move together
        after = max([floor] + [position[u] for u in problem.touchers[largest] if u != v and not descendants[u] >> v & 1])
        movers = [u for u in order[after + 1 : here + 1] if u == v or descendants[u] >> v & 1]
        if len(movers) == here - after:  # nothing else in between: already there
            continue
        moving = set(movers)
        start, stop = after + 1, here + 1  # the stretch that changes; the rest of the profile stays
        segment = movers + [u for u in order[start:stop] if u not in moving]
        live = profile[start] - problem.peak_alloc[order[start]]  # live bytes before the stretch runs
        stretch = stretch_profile(problem, segment, start, position, live)
        if max(stretch) <= peak and sum(stretch) < sum(profile[start:stop]):
            order = order[:start] + segment + order[stop:]
            profile[start:stop] = stretch
            peak = max(profile)
            position = {u: i for i, u in enumerate(order)}
    return order


def _after_predecessors(root: int, predecessors: Callable[[int], list[int]], done: set[int], out: list[int]) -> None:
    """Append ``root`` to ``out`` after those of ``predecessors(root)`` not in ``done``, recursively (no recursion).

    ``predecessors(v)`` are pushed in the order given, so its last one runs first.
    Raises ValueError where a node is its own ancestor (it would loop forever).
    """
    stack, open_ = [(root, False)], set()
    while stack:
        v, expanded = stack.pop()
        if v in done:
            continue
        if expanded:
            done.add(v)
            open_.discard(v)
            out.append(v)
            continue
        if v in open_:  # reached again while its own predecessors are being scheduled
            raise ValueError("the problem's constraints have a cycle")
        open_.add(v)
        stack.append((v, True))
        stack += [(p, False) for p in predecessors(v) if p not in done]


def _hoist(
    order: list[int], movers: frozenset[int], anchors, floor: int | None, first: frozenset[int] = frozenset()
) -> list[int]:
    """Move each mover up to right after the latest of its anchors (never above position ``floor``).

    Sort keys are tuples: a staying node is ``(position,)``; a moved one is its
    anchor's key plus ``(rank, k)``, which sorts after the anchor and before the
    next staying node. Movers in ``first`` take rank 0 and the others 1, so of
    the movers after one anchor those of ``first`` (pack chains, which free the
    tensor they read) run before the others (a compiled loss's compute, which
    allocates); ``k`` keeps moved nodes of one rank in their relative order (a
    chain's links follow each other). A mover that depends on another is
    anchored after it, whatever their ranks.
    """
    key: dict[int, tuple[int, ...]] = {v: (i,) for i, v in enumerate(order)}
    for k, v in enumerate(order):
        if v in movers:
            anchor = max([key[u] for u in anchors(v)] + ([] if floor is None else [(floor,)]), default=None)
            if anchor is not None and anchor < key[v]:
                key[v] = anchor + (0 if v in first else 1, k)
    return sorted(order, key=key.__getitem__)
