"""Choose an option per saved tensor so that the step's peak meets a budget at the least modelled time.

Design notes
------------
* A :class:`Unit` gets one choice: the saved tensors of one plan key (or of
  views sharing a storage), the bytes they hold, their spans on the step
  timeline (:mod:`savedhooks.planner.census`), each with the bytes of the
  tensor it belongs to, and the options, ``options[0]`` being to keep them as
  they are (no time, no saving). Choosing option ``o`` lowers each point of a
  tensor's span by that tensor's share of ``bytes - o.payload`` (payloads are
  taken as proportional to bytes). An option whose decode inductor fuses into
  the readers (``Option.fused``: bf16, fp8) also lowers the unit's ``reread``
  spans, where the others (offload's copy back) hold the whole tensor again.
  The modelled peak is the largest point.
* Greedy: while the peak is above the budget, take the move (a unit covering the
  peak point, to an option with a smaller payload) that frees the most bytes at
  that point per second it adds; ties go to more bytes, then to the lower key.
  Payloads only shrink from move to move, and no move may raise the peak (an
  unfused option, offload, that replaces a fused one raises the reread spans).
  The floor is where the greedy stops with a budget of 0; with fused options
  only, that is every unit at its smallest payload (:func:`floor_of`).
* Relax: then, the units in order of decreasing time, each tries its options in
  list order (keep, then the wider ones) up to its choice and takes the first
  that keeps the peak within budget: moves that later moves made unnecessary go,
  and wider (more accurate) options replace narrower ones where the budget allows.
* Fidelity (:func:`search_within`): an option may carry ``harm``, its
  modelled share of the gradients' noise power (:mod:`savedhooks.planner.fidelity`);
  a plan's harm is the sum of its choices'. The search weighs time and harm at
  a ``price`` (seconds per unit of harm): the greedy's rate is bytes per
  ``seconds + price * harm`` added, and the relax visits costlier choices
  first and, at a positive price, skips a wider option that both harms and
  costs more than the choice it would replace. :func:`search_within` meets a limit on the harm at the least time:
  price 0 first (the search above), then, while the harm is above the limit,
  a price raised 16-fold per try, then halved back in the geometric mean
  (bisection) between the last price above the limit and the first within,
  keeping the plan with the least time that meets it: a Lagrangian relaxation
  of "least time under two budgets", exact neither way (the greedy is not).
* Deterministic; the log lists each move and the peak after it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = ["PRICE_TRIES", "Option", "SearchResult", "Unit", "floor_of", "peak_of", "result_of", "search", "search_within", "sqnr_db"]

PRICE_TRIES = 24  # searches at most per search_within call after the first (raising, then bisecting the price)


def sqnr_db(harm: float) -> float:
    """The worst-parameter gradient SQNR (dB) that a harm predicts (:mod:`savedhooks.planner.fidelity`).

    Args:
        harm: a sum of noise-to-signal power ratios (non-negative).

    Returns:
        ``-10 * log10(harm)``; ``inf`` for no harm.

    Raises:
        ValueError: ``harm`` is negative or NaN.
    """
    if not harm >= 0:
        raise ValueError(f"sqnr_db: harm must be a non-negative number, got {harm}")
    return math.inf if harm == 0 else -10.0 * math.log10(harm)


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to hold a unit's tensors.

    Attributes:
        name: ``"keep"`` or a codec name (``"bf16"``, ``"fp8"``, ``"bitmask"``, ``"offload"``, ``"int8rows"``).
        payload: device bytes held while packed.
        seconds: modelled time added per step (pack and unpack).
        fused: its decode runs inside the readers' kernels (it frees the unit's
            ``reread`` spans too).
        harm: its modelled share of the gradients' noise power (0 for
            lossless options, and where fidelity is not measured).
    """

    name: str
    payload: int
    seconds: float
    fused: bool = False
    harm: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.harm < math.inf:
            raise ValueError(f"option {self.name}: harm must be a finite non-negative number, got {self.harm}")

    def cost(self, price: float) -> float:
        """Its time plus its harm at ``price`` seconds per unit of harm."""
        return self.seconds + price * self.harm if self.harm and price else self.seconds


@dataclasses.dataclass(frozen=True)
class Unit:
    """Saved tensors that get one choice (see the module notes).

    Attributes:
        key: the plan key.
        bytes: bytes held when kept.
        spans: ``(start, end, tensor_bytes)``: the points of the timeline where
            packing one of its tensors frees bytes, and that tensor's bytes.
        options: ``options[0]`` keeps; the others pack.
        reread: spans as above that only a fused option frees (from a tensor's
            first use in the backward to its last).
    """

    key: str
    bytes: int
    spans: tuple[tuple[int, int, int], ...]
    options: tuple[Option, ...]
    reread: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.options or self.options[0].name != "keep":
            raise ValueError(f"unit {self.key}: options must start with 'keep', got {self.options!r}")


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What :func:`search` chose.

    Attributes:
        choice: per unit, the index of its option.
        peak: the modelled peak with that choice.
        at: the timeline point where it is reached (the first such).
        seconds: the modelled time the choice adds.
        log: the moves, in order.
        harm: the modelled harm of the choice (the sum of its options').
    """

    choice: tuple[int, ...]
    peak: int
    at: int
    seconds: float
    log: tuple[str, ...]
    harm: float = 0.0


def _share(spans: Sequence[tuple[int, int, int]], total: int, points: int) -> torch.Tensor:
    """Per point, the share of a unit's saving freed there (its tensors' bytes over the unit's)."""
    mask = torch.zeros(points, dtype=torch.float64)
    for start, end, nbytes in spans:
        mask[start:end] += nbytes / max(total, 1)
    return mask


def _mask(unit: Unit, points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit's shares: on its spans, and on its reread spans (fused options only)."""
    return _share(unit.spans, unit.bytes, points), _share(unit.reread, unit.bytes, points)


def _saving(unit: Unit, o: int, mask: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Bytes that option ``o`` frees at each point."""
    option = unit.options[o]
    return (unit.bytes - option.payload) * (mask[0] + mask[1] if option.fused else mask[0])


def _saving_at(unit: Unit, o: int, mask: tuple[torch.Tensor, torch.Tensor], at: int) -> float:
    """Bytes that option ``o`` frees at point ``at``."""
    option = unit.options[o]
    share = float(mask[0][at]) + (float(mask[1][at]) if option.fused else 0.0)
    return (unit.bytes - option.payload) * share


def _live(live: torch.Tensor, units: Sequence[Unit], masks: Sequence, choice: Sequence[int]) -> torch.Tensor:
    out = live.clone()
    for unit, mask, o in zip(units, masks, choice):
        out -= _saving(unit, o, mask)
    return out


def _peak(points: torch.Tensor) -> int:
    return round(float(points.max()))


def _totals(units: Sequence[Unit], choice: Sequence[int]) -> tuple[float, float]:
    """The time and the harm a choice adds."""
    chosen = [unit.options[o] for unit, o in zip(units, choice)]
    return sum(o.seconds for o in chosen), sum(o.harm for o in chosen)


def result_of(live: Sequence[int], units: Sequence[Unit], choice: Sequence[int], log: Sequence[str] = ()) -> SearchResult:
    """A choice made elsewhere, modelled as :func:`search` models its own.

    Args:
        live: the timeline's bytes with nothing packed.
        units: the units.
        choice: per unit, an option index.
        log: what made the choice.

    Returns:
        A :class:`SearchResult` (peak 0 at point 0 for an empty timeline).

    Raises:
        IndexError: a choice is not an option of its unit.
    """
    seconds, harm = _totals(units, choice)
    if not live:
        return SearchResult(tuple(choice), 0, 0, seconds, tuple(log), harm)
    timeline = torch.tensor(live, dtype=torch.float64)
    points = _live(timeline, units, [_mask(u, len(live)) for u in units], choice)
    return SearchResult(tuple(choice), _peak(points), int(points.argmax()), seconds, tuple(log), harm)


def peak_of(live: Sequence[int], units: Sequence[Unit], choice: Sequence[int]) -> int:
    """The modelled peak of a choice.

    Args:
        live: the timeline's bytes with nothing packed.
        units: the units.
        choice: per unit, an option index.

    Returns:
        The largest point (0 for an empty timeline).

    Raises:
        IndexError: a choice is not an option of its unit.
    """
    return result_of(live, units, choice).peak


def floor_of(units: Sequence[Unit]) -> tuple[int, ...]:
    """The choice that frees the most: every unit at its smallest payload (the first such option).

    Args:
        units: the units.

    Returns:
        Per unit, an option index.
    """
    return tuple(min(range(len(u.options)), key=lambda o, u=u: (u.options[o].payload, o)) for u in units)


def search(live: Sequence[int], units: Sequence[Unit], budget: int, price: float = 0.0) -> SearchResult:
    """Meet ``budget`` at the least modelled cost (greedy, then relax; see the module notes).

    Args:
        live: the timeline's bytes with nothing packed.
        units: the units.
        budget: the peak to meet, in bytes.
        price: seconds per unit of harm (the cost of an option is
            ``seconds + price * harm``); 0: time alone.

    Returns:
        A :class:`SearchResult`; its peak is above ``budget`` only when the floor is.
    """
    if not live:
        return SearchResult(tuple(0 for _ in units), 0, 0, 0.0, (), 0.0)
    timeline = torch.tensor(live, dtype=torch.float64)
    masks = [_mask(u, len(live)) for u in units]
    choice = [0] * len(units)
    current = timeline.clone()
    log: list[str] = []
    while _peak(current) > budget:
        at = int(current.argmax())
        best: tuple[tuple[float, int], int, int] | None = None  # units are in key order: the first wins ties
        peak = _peak(current)
        for u, (unit, mask) in enumerate(zip(units, masks)):
            if not (mask[0][at] or mask[1][at]):
                continue
            here = unit.options[choice[u]]
            for o, option in enumerate(unit.options):
                if option.payload >= here.payload:  # payloads only shrink: no move is undone
                    continue
                freed = _saving_at(unit, o, mask, at) - _saving_at(unit, choice[u], mask, at)
                if freed <= 0:
                    continue
                if not option.fused and here.fused and mask[1].any():  # it may raise the reread spans
                    delta = _saving(unit, o, mask) - _saving(unit, choice[u], mask)
                    if _peak(current - delta) > peak:
                        continue
                rate = freed / max(option.cost(price) - here.cost(price), 1e-12)
                score = (rate, freed)
                if best is None or score > best[0]:
                    best = (score, u, o)
        if best is None:
            log.append(f"no move frees bytes at point {at}: the floor is {_peak(current)} bytes")
            break
        _, u, o = best
        current -= _saving(units[u], o, masks[u]) - _saving(units[u], choice[u], masks[u])
        log.append(
            f"{units[u].key}: {units[u].options[choice[u]].name} -> {units[u].options[o].name}, peak {_peak(current)}"
        )
        choice[u] = o
    if _peak(current) <= budget:
        order = sorted(range(len(units)), key=lambda u: (-units[u].options[choice[u]].cost(price), units[u].key))
        for u in order:
            here = units[u].options[choice[u]]
            for o in range(choice[u]):
                wider = units[u].options[o]
                if price and wider.harm > here.harm and wider.cost(price) > here.cost(price):
                    continue  # priced, a wider option that harms more (offload -> fp8) is no relief
                delta = _saving(units[u], choice[u], masks[u]) - _saving(units[u], o, masks[u])
                if _peak(current + delta) <= budget:
                    current += delta
                    log.append(
                        f"relax {units[u].key}: {units[u].options[choice[u]].name} -> "
                        f"{units[u].options[o].name}, peak {_peak(current)}"
                    )
                    choice[u] = o
                    break
    seconds, harm = _totals(units, choice)
    return SearchResult(tuple(choice), _peak(current), int(current.argmax()), seconds, tuple(log), harm)


def search_within(
    live: Sequence[int], units: Sequence[Unit], budget: int, max_harm: float = math.inf, tries: int = PRICE_TRIES
) -> SearchResult:
    """Meet ``budget`` with a harm of at most ``max_harm`` at the least modelled time (see the module notes).

    Args:
        live: the timeline's bytes with nothing packed.
        units: the units.
        budget: the peak to meet, in bytes.
        max_harm: the most harm the choice may have (``math.inf``: none; :func:`search`).
        tries: searches at most after the first (at least 1 where ``max_harm`` is finite).

    Returns:
        A :class:`SearchResult`: of those tried that meet the budget and
        ``max_harm``, the least time (then harm); where none does, the least
        harm tried. Its log ends with the price kept.

    Raises:
        ValueError: ``max_harm`` is negative or NaN, or ``tries`` below 1.
    """
    if not max_harm >= 0:
        raise ValueError(f"search_within: max_harm must be a non-negative number, got {max_harm}")
    if tries < 1:
        raise ValueError(f"search_within: tries must be at least 1, got {tries}")
    first = search(live, units, budget)
    if first.harm <= max_harm:
        if max_harm < math.inf:
            line = f"fidelity: price 0, harm {first.harm:.3g} (limit {max_harm:.3g}), 1 search"
            return dataclasses.replace(first, log=(*first.log, line))
        return first
    tried = {0.0: first}
    low, high = 0.0, max(first.seconds, 1e-9) / first.harm  # a price at which the harm costs as much as the time
    for _ in range(tries):
        tried[high] = search(live, units, budget, high)
        if tried[high].harm <= max_harm:
            break
        low, high = high, high * 16
    else:
        high = math.inf
    while len(tried) <= tries and high < math.inf:
        middle = math.sqrt(low * high) if low else high / 16
        if middle in tried:
            break
        tried[middle] = search(live, units, budget, middle)
        if tried[middle].harm <= max_harm:
            high = middle
        else:
            low = middle
    meets = [(p, r) for p, r in tried.items() if r.harm <= max_harm and r.peak <= budget]
    if meets:
        price, kept = min(meets, key=lambda pr: (pr[1].seconds, pr[1].harm))
    else:
        price, kept = min(tried.items(), key=lambda pr: pr[1].harm)
    line = f"fidelity: price {price:.3g} s per unit of harm, harm {kept.harm:.3g} (limit {max_harm:.3g}), {len(tried)} searches"
    return dataclasses.replace(kept, log=(*kept.log, line))
