"""Static memory plan for an order: an offset per buffer in one arena, and the fragmentation gap.

Design notes
------------
* The model. An order of the graph's nodes gives every buffer a lifetime: the
  closed range ``[start, end]`` of positions from the node that allocates it to
  the last node that touches it (allocates or reads it through any alias), as
  :func:`savedhooks.memory.simulate_order` frees it; graph outputs (and other
  buffers that are never freed) live to the last position. Two buffers whose
  lifetimes share a position are alive at the same time and must not overlap in
  memory. A plan gives each buffer an offset in one arena of ``arena_bytes``.
* What is planned. Only what the graph allocates on the device: graph inputs,
  donated or not, are owned by the caller (they were allocated before the graph
  ran) and are not in the arena. A node's scratch (:attr:`GraphMemory.scratch`,
  the temporaries of our own ops) is planned as a buffer alive at its node's
  position only, as the model's "during" figure counts it.
* The lower bound. ``liveness_peak`` is the largest sum of sizes alive at one
  position, over the same buffers: ``simulate_order``'s peak minus the inputs'
  bytes when no input is donated. No arena can be smaller, since the buffers
  alive at the peak need disjoint bytes. ``arena_bytes - liveness_peak`` is the
  fragmentation gap of the plan.
* Alignment. With ``alignment=A`` (a power of two) every size is rounded up to a
  multiple of ``A`` and every offset is a multiple of ``A``. ``A=512`` is the
  CUDA caching allocator's rounding of small blocks (:data:`CUDA_ALIGNMENT`); it
  does not model the allocator's 2 MiB segments, its splitting rules or its
  per-stream pools. ``liveness_peak`` stays on the exact sizes, so with ``A > 1``
  the gap includes the rounding. The default is 1: the plan compares with the
  memory model's figures byte for byte.
* The strategies (one signature, ``strategy(sizes, starts, ends) -> offsets``,
  sizes already aligned, zero sizes ignored and put at 0), after Pisarchyk and
  Lee, "Efficient Memory Management for Deep Neural Net Inference" (2020), as
  TorchScript's static memory planning (PyTorch PR #64347) has them:

  - ``greedy_by_size``: largest buffer first; each goes into the smallest gap,
    between the buffers already placed that are alive with it, that fits it, or
    above the highest of them.
  - ``greedy_by_breadth``: the same placement, buffers taken by the position of
    largest breadth (bytes alive there) in their lifetime, widest first, and by
    size within it: the paper's "operators by breadth, their tensors by size".
  - ``linear_scan``: positions in order; at each, the buffers dead before it
    give their blocks back (coalesced), and the buffers born at it take the
    smallest free block that fits, or the top of the arena. On buffers of one
    size it reaches the liveness peak (interval partitioning).
  - ``iterated_greedy``: TorchScript's greedy by longest lifetime (then size),
    then a few rounds that put the buffers reaching the top of the last plan
    first and place again, keeping the smallest. On the reorder pass's orders
    none of the three above stays within 10 % of the liveness peak on every
    benchmark graph (GPT-2's forward is one).

  ``strategy="best"`` runs all of them and keeps the smallest arena (the first
  listed on ties), logging every figure. They live in
  :mod:`savedhooks.memory.arena_strategies`.
* Cost. Linear scan is O(n log n) plus the free list. The greedy placements
  look at the placed buffers alive with the one being placed (short lifetimes
  found through an index by start, long ones kept sorted by offset), so they
  cost time in proportion to the pairs of buffers alive together.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from savedhooks.memory.arena_strategies import (
    ARENA_STRATEGIES,
    greedy_by_breadth,
    greedy_by_size,
    iterated_greedy,
    linear_scan,
)
from savedhooks.memory.estimate import _report_device
from savedhooks.memory.graph import GraphMemory, build_graph_memory
from savedhooks.memory.sizes import CUDA_BLOCK_BYTES

__all__ = [
    "ARENA_STRATEGIES",
    "CUDA_ALIGNMENT",
    "ArenaPlan",
    "Lifetime",
    "buffer_lifetimes",
    "greedy_by_breadth",
    "greedy_by_size",
    "iterated_greedy",
    "linear_scan",
    "liveness_peak",
    "plan_arena",
    "plan_lifetimes",
    "validate_arena",
]

log = logging.getLogger(__name__)

CUDA_ALIGNMENT = CUDA_BLOCK_BYTES  # the CUDA caching allocator rounds every block up to a multiple of 512 B


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """One buffer to place: its size and the closed range of positions it is alive in.

    Attributes:
        name: the node that allocates it (``"<node> (scratch)"`` for a node's scratch).
        nbytes: its size in bytes (exact, before alignment).
        start: position (in the order) of the node that allocates it.
        end: position of the last node that touches it (the last position for an output).
        buffer: its index in :attr:`GraphMemory.buffers` (None for scratch).
    """

    name: str
    nbytes: int
    start: int
    end: int
    buffer: int | None = None


@dataclasses.dataclass(frozen=True)
class ArenaPlan:
    """An offset per buffer in one arena.

    Attributes:
        lifetimes: the buffers placed.
        offsets: per buffer (same index as ``lifetimes``), its offset in bytes.
        arena_bytes: the arena's size: the highest ``offset + aligned size``.
        liveness_peak: the largest sum of exact sizes alive at one position
            (no arena can be smaller).
        strategy: the strategy that made the offsets.
        alignment: offsets are multiples of it, sizes rounded up to it.
        scores: ``arena_bytes`` per strategy tried (one entry unless ``"best"``).
    """

    lifetimes: tuple[Lifetime, ...]
    offsets: tuple[int, ...]
    arena_bytes: int
    liveness_peak: int
    strategy: str
    alignment: int
    scores: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``arena_bytes / liveness_peak`` (1.0 for an empty plan)."""
        return self.arena_bytes / self.liveness_peak if self.liveness_peak else 1.0

    def offset_of(self, name: str) -> int:
        """The offset of the buffer allocated by node ``name``.

        Args:
            name: a :attr:`Lifetime.name`.

        Returns:
            Its offset in bytes.

        Raises:
            KeyError: no buffer of that name.
        """
        for lifetime, offset in zip(self.lifetimes, self.offsets):
            if lifetime.name == name:
                return offset
        raise KeyError(f"no buffer named {name!r} in the plan")


# --- lifetimes ------------------------------------------------------------------------------------


def _check_order(memory: GraphMemory, order: Sequence[int]) -> list[int]:
    """``order`` as a list of positions per node; raises unless it is a topological permutation."""
    n = len(memory.node_names)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of the graph's {n} node indices")
    position = [0] * n
    for p, v in enumerate(order):
        position[v] = p
    for v, deps in enumerate(memory.inputs):
        for d in deps:
            if position[d] > position[v]:
                raise ValueError(
                    f"order is not topological: {memory.node_names[v]} runs before its input {memory.node_names[d]}"
                )
    return position


def buffer_lifetimes(
    memory: GraphMemory, order: Sequence[int] | None = None, device: Any = None
) -> tuple[Lifetime, ...]:
    """The buffers a graph allocates on ``device`` and their lifetimes in ``order``.

    Args:
        memory: the graph's buffer model.
        order: a topological permutation of the node indices (default: the graph's order).
        device: the device to plan (default: the first non-CPU device holding a
            buffer, else CPU, as :func:`savedhooks.memory.estimate_peak` picks it).

    Returns:
        One :class:`Lifetime` per buffer the graph allocates there (inputs left
        out), in buffer order, then one per node with scratch there.

    Raises:
        ValueError: ``order`` is not a permutation of the nodes, or not topological.
    """
    n = len(memory.node_names)
    position = _check_order(memory, range(n) if order is None else order)
    device = _report_device(memory) if device is None else torch.device(device)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for v, (made, read) in enumerate(zip(memory.allocs, memory.reads)):
        p = position[v]
        for b in made:
            start[b] = p
        for b in (*made, *read):
            end[b] = max(end.get(b, p), p)
    out = [
        Lifetime(b.name, b.nbytes, start[b.index], end[b.index] if b.freeable else n - 1, b.index)
        for b in memory.buffers
        if b.device == device and not b.is_input and b.index in start
    ]
    for v in range(n):
        extra = memory.scratch_on(v, device)
        if extra:
            out.append(Lifetime(f"{memory.node_names[v]} (scratch)", extra, position[v], position[v]))
    return tuple(out)


def liveness_peak(lifetimes: Sequence[Lifetime], alignment: int = 1) -> int:
    """The largest sum of sizes alive at one position.

    Args:
        lifetimes: the buffers.
        alignment: round each size up to a multiple of it first (1: exact sizes).

    Returns:
        The peak in bytes (0 when there is nothing).

    Raises:
        ValueError: ``alignment`` is not a power of two.
    """
    _check_alignment(alignment)
    if not lifetimes:
        return 0
    delta = [0] * (max(t.end for t in lifetimes) + 2)
    for t in lifetimes:
        size = _round_up(t.nbytes, alignment)
        delta[t.start] += size
        delta[t.end + 1] -= size
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two (1 for none, {CUDA_ALIGNMENT} as CUDA), got {alignment!r}")


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


# --- plans ----------------------------------------------------------------------------------------


def plan_lifetimes(lifetimes: Sequence[Lifetime], strategy: str = "greedy_by_size", alignment: int = 1) -> ArenaPlan:
    """Plan offsets for buffers with known lifetimes.

    Args:
        lifetimes: the buffers (e.g. :func:`buffer_lifetimes`).
        strategy: a key of :data:`ARENA_STRATEGIES`, or ``"best"`` (all of them,
            the smallest arena kept).
        alignment: a power of two; sizes round up to it, offsets are multiples of it.

    Returns:
        An :class:`ArenaPlan`.

    Raises:
        ValueError: an unknown strategy, an alignment that is not a power of two,
            or a lifetime with a negative size or ``end < start``.
    """
    if strategy != "best" and strategy not in ARENA_STRATEGIES:
        raise ValueError(f"unknown arena strategy {strategy!r}; known: best, {', '.join(ARENA_STRATEGIES)}")
    _check_alignment(alignment)
    lifetimes = tuple(lifetimes)
    bad = next((t for t in lifetimes if t.nbytes < 0 or t.start < 0 or t.end < t.start), None)
    if bad is not None:
        raise ValueError(f"lifetime of {bad.name!r} is malformed: {bad}")
    sizes = [_round_up(t.nbytes, alignment) for t in lifetimes]
    starts = [t.start for t in lifetimes]
    ends = [t.end for t in lifetimes]
    names = list(ARENA_STRATEGIES) if strategy == "best" else [strategy]
    best: tuple[int, str, list[int]] | None = None
    scores: dict[str, int] = {}
    for name in names:
        offsets = ARENA_STRATEGIES[name](sizes, starts, ends)
        arena = max((o + s for o, s in zip(offsets, sizes)), default=0)
        scores[name] = arena
        if best is None or arena < best[0]:
            best = (arena, name, offsets)
    arena, chosen, offsets = best
    peak = liveness_peak(lifetimes)
    if strategy == "best":
        log.info("savedhooks arena: %d buffers, liveness peak %d B, best %s %d B; arenas %s",
                 len(lifetimes), peak, chosen, arena, scores)  # fmt: skip
    return ArenaPlan(lifetimes, tuple(offsets), arena, peak, chosen, alignment, scores)


def plan_arena(
    graph: GraphMemory | torch.fx.GraphModule,
    order: Sequence[int] | None = None,
    strategy: str = "greedy_by_size",
    device: Any = None,
    alignment: int = 1,
    donated: tuple[str, ...] = (),
) -> ArenaPlan:
    """Plan an arena for a graph's buffers in an order: an offset per buffer it allocates.

    Args:
        graph: a :class:`GraphMemory`, or a GraphModule whose nodes carry
            ``meta["val"]`` (its memory is built with ``donated``).
        order: a topological permutation of the node indices
            (``GraphMemory.node_names``; default: the graph's order), such as a
            :class:`savedhooks.schedule.Schedule`'s ``order``.
        strategy: ``"greedy_by_size"``, ``"greedy_by_breadth"``, ``"linear_scan"``,
            ``"iterated_greedy"`` or ``"best"`` (all of them, the smallest arena kept).
        device: the device planned (default: the first non-CPU device holding a
            buffer, else CPU).
        alignment: a power of two: 1 (exact sizes) or :data:`CUDA_ALIGNMENT` (512,
            the CUDA caching allocator's rounding).
        donated: with a GraphModule, placeholders the graph may free (they are
            inputs all the same: never in the arena).

    Returns:
        An :class:`ArenaPlan`; ``arena_bytes >= liveness_peak``, and it passes
        :func:`validate_arena`.

    Raises:
        TypeError: ``graph`` is neither a GraphMemory nor a GraphModule.
        ValueError: an unknown strategy, an alignment that is not a power of two,
            an order that is not a topological permutation, or (GraphModule)
            nodes without ``meta["val"]``.
    """
    if isinstance(graph, torch.fx.GraphModule):
        graph = build_graph_memory(graph, donated)
    elif not isinstance(graph, GraphMemory):
        raise TypeError(f"plan_arena takes a GraphMemory or a GraphModule, not {type(graph).__name__}")
    if strategy != "best" and strategy not in ARENA_STRATEGIES:
        raise ValueError(f"unknown arena strategy {strategy!r}; known: best, {', '.join(ARENA_STRATEGIES)}")
    _check_alignment(alignment)
    return plan_lifetimes(buffer_lifetimes(graph, order, device), strategy, alignment)


def validate_arena(plan: ArenaPlan) -> None:
    """Check a plan: aligned offsets inside the arena, and no two buffers alive together overlapping.

    Args:
        plan: the plan.

    Raises:
        ValueError: a count mismatch, an offset that is negative, not aligned or
            past the arena, or two buffers alive at the same position whose byte
            ranges overlap (both named, with their ranges and lifetimes).
    """
    lifetimes, offsets, alignment = plan.lifetimes, plan.offsets, plan.alignment
    if len(offsets) != len(lifetimes):
        raise ValueError(f"arena plan has {len(offsets)} offsets for {len(lifetimes)} buffers")
    for t, o in zip(lifetimes, offsets):
        if t.nbytes and (o < 0 or o % alignment or o + _round_up(t.nbytes, alignment) > plan.arena_bytes):
            raise ValueError(
                f"buffer {t.name!r} at offset {o} ({t.nbytes} B) is negative, not a multiple of {alignment}, "
                f"or past the arena's {plan.arena_bytes} B"
            )
    alive: list[tuple[int, int]] = []  # (end, buffer) heap
    by_offset: list[tuple[int, int]] = []  # (offset, buffer), pairwise disjoint so far
    for i in sorted((i for i, t in enumerate(lifetimes) if t.nbytes), key=lambda i: (lifetimes[i].start, i)):
        while alive and alive[0][0] < lifetimes[i].start:
            _, j = heapq.heappop(alive)
            del by_offset[bisect.bisect_left(by_offset, (offsets[j], j))]
        at = bisect.bisect_left(by_offset, (offsets[i], i))
        for k in (at - 1, at):  # the disjoint set sorted by offset: only the neighbours can overlap
            if 0 <= k < len(by_offset):
                j = by_offset[k][1]
                lo, hi = sorted((i, j), key=lambda b: (offsets[b], b))
                if offsets[lo] + lifetimes[lo].nbytes > offsets[hi]:
                    raise ValueError(f"arena plan overlaps: {_describe(plan, lo)} and {_describe(plan, hi)} "
                                     "are alive at the same time")  # fmt: skip
        by_offset.insert(at, (offsets[i], i))
        heapq.heappush(alive, (lifetimes[i].end, i))


def _describe(plan: ArenaPlan, i: int) -> str:
    t, o = plan.lifetimes[i], plan.offsets[i]
    return f"{t.name!r} (bytes [{o}, {o + t.nbytes}), positions {t.start}..{t.end})"
