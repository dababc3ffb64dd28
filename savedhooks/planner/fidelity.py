"""Fidelity for the planner: lossy choices priced, and limited, by what :func:`savedhooks.sensitivity` measures.

Design notes
------------
* Opt-in: ``sh.plan(..., min_sqnr_db=...)``. :func:`measure_limit` runs
  :func:`savedhooks.sensitivity` once per planner, with fp8, on the model as it
  is (nothing recomputed), under the plan's backend: ``2 + 2 * groups``
  training steps, each a compile (the ``individually`` largest tensors alone,
  the rest grouped by producing op). Like a survey, it ends with
  ``torch._dynamo.reset()``, so the order of the two does not matter.
* A survey's saved tensor is matched to the report by its producing op, shape
  and dtype, not by its node name: a recompute setting renames the graphs'
  nodes, not these. Tensors alike (every layer's output of one op and shape)
  share the worst of them.
* Harm: a group's "only this packed" SQNR is a noise-to-signal power ratio,
  ``nsr = 10 ** (-only_db / 10)``, of the worst parameter's gradient. Rounding
  errors of different tensors are independent, and to first order their
  effects on a gradient add in power: the plan's harm is the sum of its
  choices', and ``-10 * log10(harm)`` its predicted worst-parameter SQNR
  (``Plan.predicted_sqnr_db``). Summing each group's worst parameter bounds
  every parameter's sum from above, so the prediction errs low. A group's
  ``nsr`` is shared among its tensors by bytes (a tensor measured alone has
  its own). bf16's harm is fp8's divided by ``10 ** (BF16_MARGIN_DB / 10)``:
  bf16 rounds to 8 significant bits, e4m3 to 4, a relative error bound of
  2^-8 against 2^-4 (24 dB; an estimate, not measured). Keep, offload and
  bitmask are lossless: no harm. Unmeasured tensors have none either.
* The limit holds for the plan: the search meets a harm of
  ``10 ** (-min_sqnr_db / 10)`` at the least time
  (:func:`~savedhooks.planner.search.search_within`), trading codec time
  (bf16 or keep for fp8), and, across recompute settings, the planner (one that saves less
  packs less) against fidelity. A tensor whose harm alone is above it cannot
  be in any such plan: fp8 (bf16, NaN) is taken from it before the search.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from savedhooks.codecs import fp8
from savedhooks.fidelity.select import SavedTensor
from savedhooks.fidelity.sensitivity import sensitivity
from savedhooks.planner.result import Plan
from savedhooks.planner.survey import Survey

__all__ = ["BF16_MARGIN_DB", "FidelityLimit", "check_min_sqnr", "measure_limit", "meets_limit"]

BF16_MARGIN_DB = 24.0  # bf16's rounding error against e4m3's: 4 more significant bits
_MARGINS = {"fp8": 0.0, "bf16": BF16_MARGIN_DB}  # lossy options: dB above fp8's measured SQNR


def _signature(t: SavedTensor) -> tuple[Any, ...]:
    return (t.op, t.shape, t.dtype)


def _nsr(db: float) -> float:
    """A power ratio from dB (NaN: infinite)."""
    return math.inf if math.isnan(db) else 10.0 ** (-db / 10.0)


@dataclasses.dataclass(frozen=True)
class FidelityLimit:
    """Which lossy options a saved tensor may take.

    Attributes:
        min_sqnr_db: the least worst-parameter gradient SQNR a plan may be
            predicted at (and a lossy choice cost on its own).
        only_db: (producing op, shape, dtype) -> the worst SQNR measured with
            tensors of that signature packed alone in fp8.
        per_byte: (producing op, shape, dtype) -> fp8's harm per byte of a
            tensor of that signature (the worst of the groups holding one).
    """

    min_sqnr_db: float
    only_db: Mapping[tuple[Any, ...], float]
    per_byte: Mapping[tuple[Any, ...], float] = dataclasses.field(default_factory=dict)

    @property
    def max_harm(self) -> float:
        """The most harm a plan may have: ``10 ** (-min_sqnr_db / 10)``."""
        return _nsr(self.min_sqnr_db)

    def harm(self, option: str, tensors: Iterable[SavedTensor]) -> float:
        """The modelled harm of holding ``tensors`` with ``option`` (see the module notes).

        Args:
            option: an option name of the survey.
            tensors: the census entries it would hold.

        Returns:
            0 for lossless options and unmeasured tensors; else the sum over the
            tensors of fp8's harm per byte times their bytes, less bf16's margin.

        Raises:
            Nothing.
        """
        margin = _MARGINS.get(option)
        if margin is None:
            return 0.0
        fp8_harm = sum(self.per_byte.get(_signature(t), 0.0) * t.bytes for t in tensors)
        return fp8_harm * 10.0 ** (-margin / 10.0)

    def allows(self, option: str, tensors: Iterable[SavedTensor]) -> bool:
        """Whether ``option`` may hold ``tensors``: lossless options always; lossy ones if each tensor's estimate meets the limit.

        Args:
            option: an option name of the survey (``"keep"``, ``"bf16"``, ``"fp8"``, ...).
            tensors: the census entries the option would hold.

        Returns:
            False when a tensor's measured fp8 SQNR (plus the option's margin) is
            below :attr:`min_sqnr_db` or is NaN; True otherwise (unmeasured tensors too).

        Raises:
            Nothing.
        """
        margin = _MARGINS.get(option)
        if margin is None:
            return True
        return all(self.only_db.get(_signature(t), math.inf) + margin >= self.min_sqnr_db for t in tensors)

    def restrict(self, found: Survey) -> tuple[Survey, int]:
        """``found`` with the options this limit forbids taken out of its units, the others' harm set, and the plan's limit.

        Args:
            found: a survey.

        Returns:
            ``(survey, units)``: the restricted survey (its ``max_harm`` this
            limit's) and how many units lost an option.

        Raises:
            Nothing.
        """
        units, limited = [], 0
        for unit in found.units:
            saved = found.saved[unit.key]
            options = tuple(
                dataclasses.replace(o, harm=self.harm(o.name, saved))
                for o in unit.options
                if self.allows(o.name, saved)
            )
            limited += len(options) < len(unit.options)
            units.append(dataclasses.replace(unit, options=options))
        return dataclasses.replace(found, units=tuple(units), max_harm=self.max_harm), limited


def check_min_sqnr(min_sqnr_db: Any) -> None:
    """Validate ``sh.plan``'s ``min_sqnr_db``.

    Args:
        min_sqnr_db: None, or a finite real number of dB.

    Returns:
        None.

    Raises:
        TypeError: not None and not a real number (bools are refused).
        ValueError: not finite.
    """
    if min_sqnr_db is None:
        return
    if isinstance(min_sqnr_db, bool) or not isinstance(min_sqnr_db, (int, float)):
        raise TypeError(f"plan: min_sqnr_db must be a number of dB or None, got {min_sqnr_db!r}")
    if not math.isfinite(min_sqnr_db):
        raise ValueError(f"plan: min_sqnr_db must be finite, got {min_sqnr_db!r}")


def measure_limit(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    backend: str,
    seed: int,
    min_sqnr_db: float,
    individually: int = 8,
) -> FidelityLimit:
    """Run :func:`savedhooks.sensitivity` (fp8) and keep each signature's worst "only this packed" SQNR and harm per byte.

    Args:
        model: as for :func:`savedhooks.plan`.
        example_inputs: as for :func:`savedhooks.plan`.
        loss_fn: as for :func:`savedhooks.plan`.
        backend: as for :func:`savedhooks.plan`.
        seed: as for :func:`savedhooks.plan`.
        min_sqnr_db: the limit (see :class:`FidelityLimit`).
        individually: the largest saved tensors measured alone; the rest are grouped by op.

    Returns:
        A :class:`FidelityLimit`.

    Raises:
        ValueError: as :func:`savedhooks.sensitivity` (no parameter gets a
            gradient, no floating output and no ``loss_fn``).
    """
    report = sensitivity(model, example_inputs, fp8(), loss_fn, backend, individually, seed, verbose=False)
    only: dict[tuple[Any, ...], float] = {}
    per_byte: dict[tuple[Any, ...], float] = {}
    for group in report.groups:
        share = _nsr(group.only_db) / max(group.bytes, 1)
        for t in group.tensors:
            worst = only.get(_signature(t), math.inf)
            only[_signature(t)] = group.only_db if math.isnan(group.only_db) else min(worst, group.only_db)
            per_byte[_signature(t)] = max(per_byte.get(_signature(t), 0.0), share)
    return FidelityLimit(float(min_sqnr_db), only, per_byte)


def meets_limit(plan: Plan, min_sqnr_db: float | None) -> bool:
    """Whether a plan's predicted gradient SQNR meets ``min_sqnr_db``.

    Args:
        plan: a plan.
        min_sqnr_db: the limit, or None.

    Returns:
        True without a limit or a prediction; else whether ``plan.predicted_sqnr_db >= min_sqnr_db``.

    Raises:
        Nothing.
    """
    return min_sqnr_db is None or plan.predicted_sqnr_db is None or plan.predicted_sqnr_db >= min_sqnr_db
