"""Fidelity for the planner: lossy choices priced, and limited, by what :func:`savedhooks.fidelity.sensitivity` measures.

Design notes
------------
* Opt-in: ``sh.plan(..., min_sqnr_db=...)``. :func:`measure_limit` runs
  :func:`savedhooks.fidelity.sensitivity` once per planner, with fp8, on the model as it
  is (nothing recomputed), under the plan's backend: ``2 + 2 * groups``
  training steps, each a compile (the ``individually`` largest tensors alone,
  the rest grouped by producing op). Like a survey, it ends with
  ``torch.compiler.reset()``, so the order of the two does not matter.
* A survey's saved tensor is matched to the report by its producing op, shape
  and dtype, not by its node name: a recompute setting renames the graphs'
  nodes, not these. Tensors alike (every layer's output of one op and shape)
  share the worst of them.
* Harm: a group's "only this packed" SQNR is a noise-to-signal power ratio,
  ``nsr = 10 ** (-only_db / 10)``, of the worst parameter's gradient. Rounding
  errors of different tensors are independent, and to first order their
  effects on a gradient add in power: the plan's harm is the sum of its
  choices', and ``-10 * log10(harm)`` its predicted worst-parameter SQNR
  (``Plan.predicted_sqnr_db``). A group's ``nsr`` is shared among its tensors
  by bytes (a tensor measured alone has its own): an estimate. Summing each
  group's worst parameter over-counts (each parameter's own sum is no
  larger), so the prediction tends to err low. A tensor the report did not
  list (a recompute setting can save one the model without recompute does
  not) takes the worst harm per byte measured. bf16's harm is fp8's divided
  by ``10 ** (BF16_MARGIN_DB / 10)``: bf16 rounds to 8 significant bits, e4m3
  to 4, a relative error bound of 2^-8 against 2^-4 (24 dB; an estimate, not
  measured); int8 rows' is fp8's less ``INT8_ROWS_MARGIN_DB`` (12 dB: its
  error is 2^-8 of a row's largest, 24 dB better than e4m3's for the largest
  values and no better for those 16 times smaller; an estimate). Keep,
  offload and bitmask are lossless: no harm.
* The limit holds for the plan: the search meets a harm of
  ``10 ** (-min_sqnr_db / 10)`` at the least time
  (:func:`~savedhooks.planner.search.search_within`), trading codec time
  (bf16, keep or offload for fp8) against fidelity, and the planner ranks the
  recompute settings whose plans meet it (one that saves less packs less). A
  unit whose option's harm alone is above the limit cannot be in any such
  plan: the option is taken from it before the search (NaN gradients: an
  infinite harm).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from savedhooks._torch import aot, inductor
from savedhooks.codecs import fp8
from savedhooks.fidelity.select import SavedTensor
from savedhooks.fidelity.sensitivity import default_loss, sensitivity
from savedhooks.planner.caches import caches_off
from savedhooks.planner.result import Plan
from savedhooks.planner.step import train_step
from savedhooks.planner.survey import Survey

__all__ = [
    "BF16_MARGIN_DB",
    "FidelityLimit",
    "INT8_ROWS_MARGIN_DB",
    "check_min_sqnr",
    "fidelity_line",
    "measure_limit",
    "meets_limit",
    "predicted_db",
]

BF16_MARGIN_DB = 24.0  # bf16's rounding error against e4m3's: 4 more significant bits
# int8 rows' error, 2**-8 of a row's largest, against e4m3's 2**-4 of each value: 24 dB for a row's largest
# values, none for those 16 times smaller; half of it, an estimate
INT8_ROWS_MARGIN_DB = 12.0
_MARGINS = {"fp8": 0.0, "bf16": BF16_MARGIN_DB, "int8rows": INT8_ROWS_MARGIN_DB}  # lossy: dB above fp8's measured
_DB_SLACK = 1e-9  # a harm at the limit, read back in dB


def _signature(t: SavedTensor) -> tuple[Any, ...]:
    return (t.op, t.shape, t.dtype)


def _nsr(db: float) -> float:
    """A power ratio from dB (NaN: infinite)."""
    return math.inf if math.isnan(db) else 10.0 ** (-db / 10.0)


@dataclasses.dataclass(frozen=True)
class FidelityLimit:
    """What lossy options cost in fidelity (their harm), and the most a plan may have.

    Attributes:
        min_sqnr_db: the least worst-parameter gradient SQNR a plan may be predicted at.
        per_byte: (producing op, shape, dtype) -> fp8's harm per byte of a
            tensor of that signature (the worst of the groups holding one;
            ``inf`` where its gradients were NaN).
        reference: the parameter gradients of an eager step without hooks
            (CPU copies), against which a checked plan's are measured.
    """

    min_sqnr_db: float
    per_byte: Mapping[tuple[Any, ...], float]
    reference: Mapping[str, torch.Tensor | None] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def max_harm(self) -> float:
        """The most harm a plan may have: ``10 ** (-min_sqnr_db / 10)``."""
        return _nsr(self.min_sqnr_db)

    @functools.cached_property
    def _unmeasured(self) -> float:
        """The harm per byte of a tensor the report did not list: the worst measured (finite), to be safe."""
        return max((h for h in self.per_byte.values() if math.isfinite(h)), default=0.0)

    def harm(self, option: str, tensors: Iterable[SavedTensor]) -> float:
        """The modelled harm of holding ``tensors`` with ``option`` (see the module notes).

        Args:
            option: an option name of the survey.
            tensors: the census entries it would hold.

        Returns:
            0 for lossless options; else the sum over the tensors of fp8's harm
            per byte (for a tensor the report did not list, the worst measured)
            times their bytes, less bf16's margin; ``inf`` where one's gradients were NaN.
        """
        margin = _MARGINS.get(option)
        if margin is None:
            return 0.0
        fp8_harm = sum(self.per_byte.get(_signature(t), self._unmeasured) * t.bytes for t in tensors)
        return fp8_harm * 10.0 ** (-margin / 10.0)

    def allows(self, option: str, tensors: Iterable[SavedTensor]) -> bool:
        """Whether ``option`` may hold ``tensors`` in some plan: its harm alone is within the limit.

        Args:
            option: an option name of the survey (``"keep"``, ``"bf16"``, ``"fp8"``, ...).
            tensors: the census entries the option would hold (one unit's).

        Returns:
            True for lossless options; for lossy ones, whether their harm is at most :attr:`max_harm`.
        """
        return self.harm(option, tensors) <= self.max_harm

    def restrict(self, found: Survey) -> tuple[Survey, int]:
        """``found`` with the options this limit forbids taken out of its units, the others' harm set, and the plan's limit.

        Args:
            found: a survey.

        Returns:
            ``(survey, units)``: the restricted survey (its ``max_harm`` this
            limit's) and how many units lost an option.
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
    """Run :func:`savedhooks.fidelity.sensitivity` (fp8) and keep each signature's harm per byte (the worst of its groups), and reference gradients.

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
        ValueError: as :func:`savedhooks.fidelity.sensitivity` (no parameter gets a
            gradient, no floating output and no ``loss_fn``).
    """
    # its census of saved tensors is taken while the graphs are traced: a compile served from inductor's FX
    # graph cache or AOTAutograd's cache traces nothing, and the report came out empty (every harm 0)
    with (
        aot.config.patch(enable_autograd_cache=False),
        inductor.config.patch(fx_graph_cache=False),
        caches_off(model),  # as the plan trains
    ):
        report = sensitivity(model, example_inputs, fp8(), loss_fn, backend, individually, seed, verbose=False)
    if not report.groups:
        warnings.warn(
            "sh.plan: sh.fidelity.sensitivity listed no saved tensor to pack: min_sqnr_db prices nothing", stacklevel=2
        )
    reference: dict[str, torch.Tensor | None] = {}
    train_step(model, model, example_inputs, loss_fn or default_loss, seed, reference)
    per_byte: dict[tuple[Any, ...], float] = {}
    for group in report.groups:
        share = _nsr(group.only_db) / max(group.bytes, 1)
        for t in group.tensors:
            per_byte[_signature(t)] = max(per_byte.get(_signature(t), 0.0), share)
    return FidelityLimit(float(min_sqnr_db), per_byte, reference)


def meets_limit(plan: Plan, min_sqnr_db: float | None) -> bool:
    """Whether a plan's gradient SQNR (checked where it was, else predicted) meets ``min_sqnr_db``.

    Args:
        plan: a plan.
        min_sqnr_db: the limit, or None.

    Returns:
        True without a limit or a figure; else whether ``plan.checked_sqnr_db``
        (or, unchecked, ``plan.predicted_sqnr_db``) is at least ``min_sqnr_db``.
    """
    db = plan.predicted_sqnr_db if plan.checked_sqnr_db is None else plan.checked_sqnr_db
    if min_sqnr_db is None or db is None:
        return True
    return db >= min_sqnr_db - _DB_SLACK  # the search compared harms: log10's rounding


def predicted_db(plan: Plan) -> str:
    """A plan's predicted SQNR for a log line.

    Args:
        plan: a plan.

    Returns:
        ``", predicted 41.3 dB"``, or ``""`` where fidelity was not measured.
    """
    return "" if plan.predicted_sqnr_db is None else f", predicted {plan.predicted_sqnr_db:.1f} dB"


def fidelity_line(plan: Plan, min_sqnr_db: float, lost: int) -> str:
    """The planner's log line on the kept plan's fidelity.

    Args:
        plan: the plan kept.
        min_sqnr_db: the limit.
        lost: how many of its setting's choices lost a lossy option before the search.

    Returns:
        The line (``"fidelity: predicted ..."``).
    """
    checked = "" if plan.checked_sqnr_db is None else f", checked {plan.checked_sqnr_db:.1f} dB"
    return (
        f"fidelity: predicted {plan.predicted_sqnr_db:.1f} dB{checked} (min_sqnr_db {min_sqnr_db:g}); {lost} choices "
        f"(plan keys) lost fp8 or bf16 (alone predicted below {min_sqnr_db:g} dB, from sh.fidelity.sensitivity)"
    )
