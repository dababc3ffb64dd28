"""A fidelity limit for the planner: lossy choices taken away where :func:`savedhooks.sensitivity` measures harm.

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
  nodes, not these. A signature takes the worst "only this packed" SQNR of the
  groups holding a tensor with it, so a tensor measured in a group of several is
  limited by the whole group's harm, and tensors alike (every layer's output of
  one op and shape) share the worst of them: conservative both ways.
* fp8 is taken away where that SQNR is below the limit; bf16 too where it is
  below by more than :data:`BF16_MARGIN_DB` (bf16 rounds to 8 significant bits,
  e4m3 to 4: a relative error bound of 2^-8 against 2^-4, 24 dB; an estimate,
  not measured). Keep, offload and bitmask are lossless and stay.
* The limit holds per tensor. The errors of many packed tensors add, so a plan's
  gradient SQNR can be below it (the pareto benchmark measures the plan's).
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
from savedhooks.planner.survey import Survey

__all__ = ["BF16_MARGIN_DB", "FidelityLimit", "check_min_sqnr", "measure_limit"]

BF16_MARGIN_DB = 24.0  # bf16's rounding error against e4m3's: 4 more significant bits
_MARGINS = {"fp8": 0.0, "bf16": BF16_MARGIN_DB}  # lossy options: dB above fp8's measured SQNR


def _signature(t: SavedTensor) -> tuple[Any, ...]:
    return (t.op, t.shape, t.dtype)


@dataclasses.dataclass(frozen=True)
class FidelityLimit:
    """Which lossy options a saved tensor may take.

    Attributes:
        min_sqnr_db: the least worst-parameter gradient SQNR a lossy choice may
            cost on its own.
        only_db: (producing op, shape, dtype) -> the worst SQNR measured with
            tensors of that signature packed alone in fp8.
    """

    min_sqnr_db: float
    only_db: Mapping[tuple[Any, ...], float]

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
        """``found`` with the options this limit forbids taken out of its units.

        Args:
            found: a survey.

        Returns:
            ``(survey, units)``: the restricted survey and how many units lost an option.

        Raises:
            Nothing.
        """
        units, limited = [], 0
        for unit in found.units:
            options = tuple(o for o in unit.options if self.allows(o.name, found.saved[unit.key]))
            limited += len(options) < len(unit.options)
            units.append(dataclasses.replace(unit, options=options))
        return dataclasses.replace(found, units=tuple(units)), limited


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
    """Run :func:`savedhooks.sensitivity` (fp8) and keep each signature's worst "only this packed" SQNR.

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
    for group in report.groups:
        for t in group.tensors:
            worst = only.get(_signature(t), math.inf)
            only[_signature(t)] = group.only_db if math.isnan(group.only_db) else min(worst, group.only_db)
    return FidelityLimit(float(min_sqnr_db), only)
