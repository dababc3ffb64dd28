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
  ``memory.py``: input order, least peak memory first, BFS, two DFS (from the
  sinks, and smallest first as inductor's), bytes-freed list scheduling and a
  beam search. Each is scored raw and after the hook placement post-pass
  (:func:`place`); :func:`schedule` keeps the lowest modelled peak, the input
  order winning ties, so the result is never worse than the input. The winner
  is placed once more when that does not raise its peak: among orders of equal
  peak, packs run as early and unpacks as late as they can.
* The exact search is best-first over scheduled sets (the live bytes after a set
  of nodes do not depend on their order, so one entry per set is enough), costs
  being the peak so far. Two safe rules keep it small: a set reached again at a
  higher peak is dropped, and a ready node that frees at least what it allocates
  without passing the peak so far is taken alone (some optimal completion starts
  with it). It stops at a state budget and then reports the gap to the best lower
  bound known instead of "optimal".
* ``score="arena"`` judges orders by the arena a static plan needs
  (:func:`savedhooks.schedule.score.arena_of`: the smallest of
  :mod:`savedhooks.memory.arena`'s strategies) instead of the liveness peak
  alone. The peak-scored choice is made first, as by default; then every order
  tried (each strategy raw and placed, the exact search's) is planned, and the
  lowest arena, then the lowest peak, wins, the peak-scored choice winning ties:
  the order changes only where the arena is strictly smaller.
* Everything is deterministic: ties break on the input order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from savedhooks.schedule.problem import Problem, build_problem, check_order, live_profile, peak_of, stretch_profile
from savedhooks.schedule.score import arena_of, problem_lifetimes
from savedhooks.schedule.search import SearchResult, beam, exact_search
from savedhooks.schedule.strategies import (
    bfs,
    bytes_freed,
    dfs,
    dfs_smallest,
    hoist_frees,
    input_order,
    lpmf,
    place,
    sink_free,
)

__all__ = [
    "SCORES",
    "STRATEGIES",
    "Problem",
    "Schedule",
    "SearchResult",
    "arena_of",
    "beam",
    "bfs",
    "build_problem",
    "bytes_freed",
    "check_order",
    "dfs",
    "dfs_smallest",
    "exact_search",
    "hoist_frees",
    "input_order",
    "live_profile",
    "lpmf",
    "peak_of",
    "place",
    "problem_lifetimes",
    "schedule",
    "sink_free",
    "stretch_profile",
]

log = logging.getLogger(__name__)


# The orders schedule(strategies=...) tries, by name; each maps a Problem to a node order.
STRATEGIES: dict[str, Callable[[Problem], list[int]]] = {
    "input": input_order,
    "lpmf": lpmf,
    "bfs": bfs,
    "dfs": dfs,
    "dfs_smallest": dfs_smallest,
    "bytes_freed": bytes_freed,
    "beam": beam,
}

SCORES = ("peak", "arena")  # what schedule(score=...) minimizes: the liveness peak, or the arena bytes, then the peak


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
        score: what was minimized (see :data:`SCORES`).
        arena: the chosen order's arena bytes (``score="arena"`` only, else None).
        arena_scores: arena bytes per order tried (``score="arena"`` only; the
            peak-scored choice as ``"peak choice"``).
    """

    order: list[int]
    peak: int
    method: str
    scores: dict[str, int]
    input_peak: int
    lower_bound: int
    optimal: bool
    score: str = "peak"
    arena: int | None = None
    arena_scores: dict[str, int] = dataclasses.field(default_factory=dict)

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
    score: str = "peak",
) -> Schedule:
    """Try every strategy (raw and placed), then the exact search; keep the lowest peak (or arena).

    Args:
        problem: the problem.
        lower_bound: a peak no order can go below (e.g.
            :func:`savedhooks.memory.lower_bound`); reaching it proves optimality.
        strategies: names from :data:`STRATEGIES`; ``"input"`` is always tried first.
        exact_budget: state budget of :func:`exact_search` (0 to skip it).
        exact_max_nodes: skip the exact search above this many nodes.
        score: ``"peak"`` (default): the lowest liveness peak; ``"arena"``: the
            lowest arena bytes of a static plan (then the lowest peak), among
            the same orders (see the module notes).

    Returns:
        A :class:`Schedule`. With ``score="peak"`` its peak is never above the
        input order's; with ``score="arena"`` its arena is never above the
        input order's nor the peak-scored choice's.

    Raises:
        ValueError: an unknown strategy name or score.
    """
    names = ["input"] + [s for s in strategies if s != "input"]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; known: {', '.join(SCORES)}")
    scores: dict[str, int] = {}
    tried: dict[str, list[int]] = {}
    best_name, best_order, best_peak = "", [], None
    for name in names:
        raw = STRATEGIES[name](problem)
        for label, order in ((name, raw), (name + "+place", place(problem, raw))):
            peak = peak_of(problem, order)
            scores[label] = peak
            tried[label] = order
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
            tried["exact"] = found.order
        optimal = found.optimal
        bound = best_peak if optimal else max(bound, found.lower_bound)
    # Among orders of equal peak, the placed one frees packed tensors soonest and
    # makes unpacked ones latest: place the winner too unless that raises its peak.
    placed = place(problem, best_order)
    if placed != best_order and peak_of(problem, placed) <= best_peak:
        best_name, best_order = best_name + "+place", placed
    log.info(
        "savedhooks schedule: %d nodes, input %d B, best %d B by %s (%s); scores %s",
        problem.size, input_peak, best_peak, best_name,
        "optimal" if optimal else f"lower bound {bound} B", scores,
    )
    chosen = Schedule(best_order, best_peak, best_name, scores, input_peak, bound, optimal)
    return chosen if score == "peak" else _by_arena(problem, chosen, tried)


def _by_arena(problem: Problem, chosen: Schedule, tried: dict[str, list[int]]) -> Schedule:
    """Among the peak-scored choice and every order tried, the lowest (arena, peak); the choice wins ties."""
    candidates = {"peak choice": chosen.order, **tried}
    arenas = {label: arena_of(problem, order) for label, order in candidates.items()}
    peaks = {label: chosen.scores.get(label, 0) for label in tried} | {"peak choice": peak_of(problem, chosen.order)}
    peaks = {label: peaks[label] for label in candidates}
    best = min(candidates, key=lambda label: (arenas[label], peaks[label]))  # first listed wins ties
    order, arena, peak = candidates[best], arenas[best], peaks[best]
    method = chosen.method if best == "peak choice" else best
    if best != "peak choice":  # place the winner too, unless that raises its arena (or, at equal arena, its peak)
        placed = place(problem, order)
        if placed != order:
            placed_arena, placed_peak = arena_of(problem, placed), peak_of(problem, placed)
            if (placed_arena, placed_peak) <= (arena, peak):
                order, method, arena, peak = placed, method + "+place", placed_arena, placed_peak
                arenas[method] = arena
    log.info("savedhooks schedule by arena: %s, arena %d B, peak %d B (peak choice: %s, arena %d B, peak %d B)",
             method, arena, peak, chosen.method, arenas["peak choice"], chosen.peak)  # fmt: skip
    return dataclasses.replace(
        chosen, order=order, peak=peak, method=method, optimal=chosen.optimal and peak == chosen.peak,
        score="arena", arena=arena, arena_scores=arenas,
    )  # fmt: skip
