"""Check a plan on the graphs compiled with its own hooks; search again below the budget until one meets it.

Design notes
------------
* The survey models the step compiled without hooks, with each packed tensor
  holding only its payload over its span (:mod:`savedhooks.planner.census`).
  The step a plan runs is compiled with the plan's hooks: the reorder pass
  places each pack and unpack, and inductor fuses and orders the kernels of
  those graphs, not of the graphs surveyed. So a plan's step can peak above
  its surveyed prediction, while the same memory model on the graphs compiled
  with its hooks follows the step (``python -m benchmarks.pareto`` measures
  both).
* :func:`check_peak` compiles the model once more, with the plan's recompute
  and hooks, runs one step (:func:`savedhooks.planner.step.record_step`) and
  models it as the survey models its own step, the eager loss's point too
  (its peak without hooks, plus the payload of each tensor it saves that the
  plan packs: a plan the planner made packs none, see the survey's notes). A
  plan that packs nothing runs the graphs surveyed: under aot_eager its
  modelled peak is checked already; under inductor it is measured as any
  other (the survey's model of a step can be off on a model it was not
  checked on).
* :func:`tighten`: search, check; while the checked peak is above the budget,
  search again with the target lowered by the excess below the plan's
  modelled peak (never below the survey's floor; lowered again while the
  search returns a choice already checked), at most :data:`ROUNDS` checks; if
  none met the budget, check the plan that packs every candidate at its
  smallest payload too.
  It returns every plan it checked with its checked peak; the planner keeps
  the least modelled time among those (and earlier ones) that meet the budget.
* Under ``torch.distributed`` with several processes (FSDP2, DDP) the checks
  run in lockstep (:mod:`savedhooks.planner.lockstep`): rank 0 decides which
  plans to check, every rank checks them, and the highest peak counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from savedhooks.compiler.api import placed_buffers, saved_tensors_hooks
from savedhooks.fidelity.sensitivity import default_loss
from savedhooks.planner.census import step_timeline
from savedhooks.planner.result import Plan
from savedhooks.planner.step import device_of, loss_peak, output_terms, record_step
from savedhooks.planner.survey import Survey

__all__ = ["ROUNDS", "cheapest", "check_peak", "choices_of", "measures", "packs_nothing", "resolve_check", "tighten",
           "warn_unchecked"]

ROUNDS = 3  # plans checked per budget and recompute setting, one compile each (then the all-packed plan)
_MiB = 1 << 20


def resolve_check(check: bool | None) -> bool:
    """Whether to check plans: ``None`` (the default) checks.

    Args:
        check: ``True``, ``False`` or ``None``.

    Returns:
        Whether to check.

    Raises:
        TypeError: ``check`` is not a bool or None.
    """
    if check is not None and not isinstance(check, bool):
        raise TypeError(f"plan: check must be True, False or None, got {check!r}")
    return check is not False


def choices_of(plan: Plan) -> tuple[tuple[str, str], ...]:
    """What identifies a plan's hooks: its choice per unit.

    Args:
        plan: a plan.

    Returns:
        ``(key, choice)`` per planned tensor, in the plan's order.
    """
    return tuple((t.key, t.choice) for t in plan.tensors)


def packs_nothing(plan: Plan) -> bool:
    """Whether the plan keeps every candidate (its step is the one surveyed).

    Args:
        plan: a plan.

    Returns:
        True if every choice is ``"keep"``.
    """
    return all(t.choice == "keep" for t in plan.tensors)


def measures(plan: Plan) -> bool:
    """Whether a check of the plan measures its step (under inductor), or only models it (aot_eager).

    Args:
        plan: a plan.

    Returns:
        True where :func:`check_peak` measures a step run as the plan runs it.
    """
    return plan.backend == "inductor"


def check_peak(
    model: torch.nn.Module,
    example_inputs: Any,
    plan: Plan,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    seed: int = 0,
    loss_bytes: int | None = None,
    grads: dict[str, torch.Tensor | None] | None = None,
    loss_saved: Collection[str] | None = None,
    readings: dict[str, int] | None = None,
) -> int:
    """The checked step peak with the plan's recompute and hooks: measured under inductor, else modelled.

    One compile and a training step that records the graphs the memory model
    reads (gradients cleared after, parameters unchanged). Under inductor one
    more step runs the same compiled graphs as a training loop does (the
    output dropped once the loss has read it unless ``plan.output_held``),
    under :func:`savedhooks.memory.measure_peak`: the measurement
    calibrates the model, and is the peak the budget is checked against.
    (Under aot_eager the recorded step runs the graphs as torch generated
    them, without the placement the plan runs with: the model alone; so too
    where a measured step compiled again.) The recompute is undone after,
    and dynamo reset.

    Args:
        model: the planned module (not compiled).
        example_inputs: as for :func:`savedhooks.plan`.
        plan: a plan for ``model`` (its ``output_held`` says how the loop holds the output).
        loss_fn: as for :func:`savedhooks.plan`.
        seed: as for :func:`savedhooks.plan`.
        loss_bytes: the eager loss's peak without hooks, as the survey measured
            it (:attr:`Survey.loss_bytes`); None: measured here, on this step's output.
        grads: filled with the step's parameter gradients (CPU copies), if given.
        loss_saved: the plan keys of the tensors the eager loss saves
            (:attr:`Survey.loss_saved`); None: every eager plan key.
        readings: filled, if given, with ``"modelled"`` and ``"measured"``
            (the latter only where it was measured).

    Returns:
        Bytes above what is alive before the step, as :attr:`Plan.predicted_peak_bytes` counts them
        (parameter gradients included).

    Raises:
        ValueError: the plan names a block that ``model`` lacks.
        NotCompiledError: the model did not compile.
    """
    loss_fn = loss_fn or default_loss
    hooks = functools.partial(_as_the_plan_runs, plan)
    step = record_step(model, example_inputs, loss_fn, plan.backend, seed, hooks, False, plan.recompute,
                       plan.recompute_mode, grads, measure=measures(plan),
                       output_held=plan.output_held)  # fmt: skip
    # the eager loss's point as the survey models it: its peak measured without hooks, plus the payload
    # of each tensor the loss saves that the plan packs (a plan made by the planner packs none: the loss
    # peaks in its backward, where a packed tensor is unpacked while its payload is held; survey notes),
    # less what packing the model's own eager saves frees. (Measured alone under the hooks, on a copy of
    # the output, the loss reads above the step's measured peak.)
    eager = [t for t in plan.tensors if t.key.startswith("eager|")]
    packed = [t for t in eager if t.choice != "keep"]
    by_loss = [loss_saved is None or t.key in loss_saved for t in packed]
    device = device_of(example_inputs)
    outlives_loss, held = output_terms(step, device, plan.output_held)
    loss = loss_peak(loss_fn, step.output, device, seed, outlives_loss) if loss_bytes is None else loss_bytes
    unpacked = sum(t.payload for t, own in zip(packed, by_loss) if own)
    freed = sum(t.bytes - t.payload for t, own in zip(packed, by_loss) if not own)
    point = max(sum(t.bytes for t in eager), loss) + unpacked - freed
    modelled = max(step_timeline(step.forwards, step.backwards, [], point, held).live, default=0)
    if readings is not None:
        readings.update(modelled=modelled, **({} if step.measured is None else {"measured": step.measured}))
    return modelled if step.measured is None else step.measured


@contextlib.contextmanager
def _as_the_plan_runs(plan: Plan) -> Iterator[None]:
    """The plan's hooks with inductor's settings as :func:`savedhooks.compiler.inductor_placement` makes them.

    The recorder places the hooks itself (the reorder pass before it keeps the
    graphs); inductor's buffer-reuse pool is off, as in the plan's own step:
    the pool keeps a freed buffer until a later one of its size takes it.
    """
    with saved_tensors_hooks(plan.hooks, reorder=False), placed_buffers():
        yield


def tighten(
    found: Survey,
    budget_bytes: int,
    check: Callable[[Plan], int],
    faithful: Callable[[Plan], bool] = lambda plan: True,
    rounds: int = ROUNDS,
) -> tuple[list[tuple[Plan, int]], list[str]]:
    """Plan ``budget_bytes`` from ``found``, check, and search again lower until a checked plan meets it.

    Args:
        found: the survey of the plan's recompute setting.
        budget_bytes: the budget (at least ``found.floor_bytes``).
        check: a plan's checked peak (:func:`check_peak`, cached by the caller).
        faithful: whether a plan meets the fidelity limit; one that does not
            is not checked, and ends the rounds (a lower target harms more).
        rounds: at most this many plans checked before the all-packed one (at least 1).

    Returns:
        ``(checked, log)``: each plan checked, with its checked peak, in order
        (none where the first is not ``faithful``); the log says what each
        round searched for and what it got.

    Raises:
        ValueError: ``rounds`` is below 1.
        InfeasibleBudgetError: the budget is below ``found.floor_bytes``.
    """
    if rounds < 1:
        raise ValueError(f"tighten: rounds must be at least 1, got {rounds}")
    checked: list[tuple[Plan, int]] = []
    log: list[str] = []
    seen: set[tuple[tuple[str, str], ...]] = set()
    target, excess = budget_bytes, 0
    while len(checked) < rounds:
        candidate = found.plan(target)
        if choices_of(candidate) in seen:  # the search's steps are coarser than the excess: lower it again
            if target == found.floor_bytes:
                break
            target = _lowered(target, candidate, excess, found.floor_bytes)
            continue
        seen.add(choices_of(candidate))
        if not faithful(candidate):
            log.append(f"searched for {target / _MiB:.2f} MiB: below the fidelity limit, not checked")
            break
        peak = check(candidate)
        checked.append((candidate, peak))
        log.append(
            f"check {len(checked)}: searched for {target / _MiB:.2f} MiB, modelled "
            f"{candidate.predicted_peak_bytes / _MiB:.2f}, {peak / _MiB:.2f} MiB on the graphs compiled with its hooks"
        )
        if peak <= budget_bytes or target == found.floor_bytes:
            break
        excess = peak - budget_bytes
        target = _lowered(target, candidate, excess, found.floor_bytes)
    if all(peak > budget_bytes for _, peak in checked):
        candidate = found.plan_smallest(budget_bytes)
        if faithful(candidate):
            peak = check(candidate)
            checked.append((candidate, peak))
            log.append(f"check: every candidate at its smallest payload, {peak / _MiB:.2f} MiB with its hooks")
        else:
            log.append("every candidate at its smallest payload: below the fidelity limit, not checked")
    return checked, log


def _lowered(target: int, candidate: Plan, excess: int, floor: int) -> int:
    """The next search's target: ``excess`` below the plan's modelled peak (the choice must change), >= ``floor``."""
    return max(min(target, candidate.predicted_peak_bytes) - excess, floor)


def cheapest(meets: list[tuple[Plan, int]], budget_bytes: int) -> Plan:
    """Of checked plans that meet a budget, the least modelled time (then peak), made for that budget.

    Args:
        meets: ``(plan, checked peak)`` pairs, not empty.
        budget_bytes: the budget they meet.

    Returns:
        The plan, its ``budget_bytes`` the budget and its ``predicted_peak_bytes`` its checked peak.

    Raises:
        ValueError: ``meets`` is empty.
    """
    plan, peak = min(meets, key=lambda pp: (pp[0].seconds, pp[1]))
    return dataclasses.replace(plan, budget_bytes=budget_bytes, predicted_peak_bytes=peak)


def warn_unchecked(log: list[str], name: str, error: Exception, then: str) -> None:
    """Warn and log that a setting's plan could not be checked (its hooked graphs did not compile, or read).

    Args:
        log: the planner's log (a line is appended).
        name: the recompute setting, as the log names it.
        error: what the check raised.
        then: what the planner does instead (in the warning).

    Raises:
        Nothing (the warning may be turned into an error by a warnings filter).
    """
    line = f"{name}: not checked: {type(error).__name__}: {error}"
    log.append(line)
    warnings.warn(f"sh.plan: {line}; {then}", stacklevel=3)
