"""Arena bytes of an order: a :class:`Problem`'s buffers planned by :mod:`savedhooks.memory.arena`.

The lifetimes are those :func:`savedhooks.memory.buffer_lifetimes` gives for
the same graph and order: a buffer is alive from its first toucher (the node
that makes it) to its last (to the end when it is never freed); graph inputs
are not planned; a node's scratch is a buffer alive at its position only. So
``arena_of(build_problem(memory, device), order)`` equals
``plan_arena(memory, order, "best", device).arena_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence

from savedhooks.memory.arena import Lifetime, plan_lifetimes
from savedhooks.schedule.problem import Problem, check_order

__all__ = ["arena_of", "problem_lifetimes"]


def problem_lifetimes(problem: Problem, order: Sequence[int]) -> tuple[Lifetime, ...]:
    """The lifetimes of a problem's buffers (inputs left out) and scratch in ``order``.

    Args:
        problem: the problem.
        order: a topological order of it.

    Returns:
        One :class:`savedhooks.memory.Lifetime` per buffer the graph allocates
        (named ``buffer <index>``), then one per node with scratch.

    Raises:
        ValueError: ``order`` is not a topological order of ``problem``.
    """
    check_order(problem, list(order))
    position = [0] * problem.size
    for p, v in enumerate(order):
        position[v] = p
    fixed = set(problem.fixed)
    last = problem.size - 1
    out = []
    for b, nodes in enumerate(problem.touchers):
        if not nodes:
            continue
        first = min(nodes, key=position.__getitem__)
        is_input = problem.inputs[b] if problem.inputs else first in fixed
        if is_input:
            continue
        end = max(position[v] for v in nodes) if problem.freeable[b] else last
        out.append(Lifetime(f"buffer {b}", problem.sizes[b], position[first], end, b))
    for v, extra in enumerate(problem.scratch):
        if extra:
            out.append(Lifetime(f"node {v} (scratch)", extra, position[v], position[v]))
    return tuple(out)


def arena_of(problem: Problem, order: Sequence[int], strategy: str = "best", alignment: int = 1) -> int:
    """Arena bytes of running ``problem`` in ``order``, its buffers placed by ``strategy``.

    Args:
        problem: the problem.
        order: a topological order of it.
        strategy: a key of :data:`savedhooks.memory.ARENA_STRATEGIES` or ``"best"``.
        alignment: a power of two (see :func:`savedhooks.memory.plan_arena`).

    Returns:
        The arena's size in bytes.

    Raises:
        ValueError: ``order`` is not a topological order, an unknown strategy,
            or an alignment that is not a power of two.
    """
    return plan_lifetimes(problem_lifetimes(problem, order), strategy, alignment).arena_bytes
