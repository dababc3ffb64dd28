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
* Everything is deterministic: ties break on the input order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from savedhooks.schedule.problem import Problem, build_problem, check_order, peak_of
from savedhooks.schedule.search import SearchResult, beam, exact_search
from savedhooks.schedule.strategies import bfs, bytes_freed, dfs, input_order, lpmf, place

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
    return Schedule(best_order, best_peak, best_name, scores, input_peak, bound, optimal)
