"""Checks in lockstep under ``torch.distributed``: rank 0 decides which plans to check, every rank checks them.

Design notes
------------
* A check (:mod:`savedhooks.planner.check`) compiles the model and runs one
  training step. Under FSDP2 or DDP that step runs collectives, so every rank
  must run the same checks in the same order. Each rank's own search would not
  do that: which plans a rank checks depends on its peaks and on the codec and
  recompute times it measured (ranks that diverge abort: gloo's "collective
  mismatch" under FSDP2).
* So rank 0 leads: before each check it broadcasts the plan (JSON) and the
  recompute setting; every rank checks that plan on its own step; the checked
  peak is the highest over the ranks (all-reduce max), so a plan that meets
  the budget meets it on every rank. When rank 0's search ends it broadcasts
  its plan, or its error, and every rank returns or raises the same.
* The surveys before it already run in lockstep: every rank surveys the same
  recompute settings in the same order, one step each.
* Every rank's peak and error travel in one gather (object collectives,
  so any backend: gloo, NCCL). A check that raises ``ValueError`` or
  ``NotCompiledError`` on any rank raises :class:`CheckFailed` on every
  rank, and the planner goes on without it as in one process; anything else
  raises :class:`ChecksAborted` on every rank, and the planning stops there.
  That holds for a check that raises after its step (the memory model cannot
  read the graphs). One that raises before or inside its step on one rank
  (a compile error, an OOM) leaves the others in the step's collectives:
  gloo aborted under FSDP2 and DDP waited until its timeout, when a test
  planted such a failure on rank 1 (``tests/distributed_worker.py`` plants
  it after the step).
* Every rank must call :func:`savedhooks.plan` (or ``Planner.plan``) with
  the same model, budget and arguments: the ranks get rank 0's plan. A
  script that plans on one rank only must pass ``check=False``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from savedhooks.planner.result import InfeasibleBudgetError, InfeasibleFidelityError, Plan
from savedhooks.planner.step import NotCompiledError

__all__ = ["CheckFailed", "ChecksAborted", "checked_together", "follow", "is_leader", "lead", "several"]

Setting = tuple[int, str]


class CheckFailed(ValueError):
    """A plan's check raised ``ValueError`` or ``NotCompiledError`` on some rank; every rank raises this.

    As in one process, the planner then warns and goes on without that check.
    """


class ChecksAborted(RuntimeError):
    """A plan's check raised anything else on some rank; every rank raises this, and the planning stops."""


_OK, _FAILED, _ABORTED = 0, 1, 2


def several() -> bool:
    """Whether ``torch.distributed`` runs several processes in its default group.

    Returns:
        True with an initialized default group of more than one process.
    """
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_leader() -> bool:
    """Whether this process decides (rank 0, or the only process).

    Returns:
        True on rank 0 or without several processes.
    """
    return not several() or torch.distributed.get_rank() == 0


def _broadcast(message: object) -> object:
    """Rank 0's ``message`` on every rank."""
    box = [message]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def checked_together(setting: Setting, plan_json: str, check: Callable[[], int]) -> int:
    """Check a plan on every rank: rank 0 announces it, each rank checks, the highest peak counts.

    Args:
        setting: the plan's recompute setting ``(k, mode)``.
        plan_json: the plan (:meth:`Plan.to_json`; rank 0's, the other ranks pass what they got).
        check: this rank's check of that plan (one compile and step).

    Returns:
        The highest checked peak over the ranks.

    Raises:
        CheckFailed: the check raised ``ValueError`` or ``NotCompiledError`` on some rank.
        ChecksAborted: it raised anything else on some rank (chained to it on that rank).
        RuntimeError: the collectives themselves failed.
    """
    if is_leader():
        _broadcast(("check", list(setting), plan_json))
    peak, kind, error = 0, _OK, None
    try:
        peak = check()
    except (ValueError, NotCompiledError) as failed:  # the hooked graphs did not compile, or read
        kind, error = _FAILED, failed
    except Exception as other:  # noqa: BLE001  the other ranks must still meet this one in the gather
        kind, error = _ABORTED, other
    everyone: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (peak, kind, repr(error)))
    worst = max(everyone, key=lambda pkw: pkw[1])
    if worst[1] == _ABORTED:
        raise ChecksAborted(f"sh.plan: a check raised on a rank: {worst[2]}") from error
    if worst[1] == _FAILED:
        raise CheckFailed(f"the check raised on a rank: {worst[2]}")
    return max(p for p, _, _ in everyone)


def lead(decide: Callable[[], Plan]) -> Plan:
    """Rank 0: run the planner's search (its checks announce themselves), then send its plan or error.

    Args:
        decide: the search with its checks.

    Returns:
        The plan ``decide`` returned.

    Raises:
        Whatever ``decide`` raises, after sending it to the other ranks
        (:class:`ChecksAborted` is raised on every rank already: not sent).
    """
    try:
        plan = decide()
    except ChecksAborted:  # every rank raised it together: no one listens any more
        raise
    except InfeasibleBudgetError as error:
        _broadcast(("infeasible", error.budget_bytes, error.floor_bytes, error.baseline_bytes, error.checked))
        raise
    except InfeasibleFidelityError as error:
        _broadcast(("unfaithful", error.budget_bytes, error.min_sqnr_db, error.best_sqnr_db, error.checked))
        raise
    except Exception as error:
        _broadcast(("error", f"{type(error).__name__}: {error}"))
        raise
    _broadcast(("plan", plan.to_json()))
    return plan


def _check_json(check: Callable[[Setting, Plan], int], setting: Setting, text: str) -> int:
    """``check`` of the plan in ``text`` (read inside the check: a bad text fails on this rank, not the gather)."""
    return check(setting, Plan.from_json(text))


def follow(check: Callable[[Setting, Plan], int]) -> Plan:
    """Every rank but 0: check what rank 0 announces until it sends its plan or error.

    Args:
        check: this rank's check of a plan (one compile and step).

    Returns:
        Rank 0's plan.

    Raises:
        InfeasibleBudgetError: rank 0's search found the budget infeasible.
        InfeasibleFidelityError: rank 0's search found no plan within it that meets ``min_sqnr_db``.
        ChecksAborted: a check raised on some rank (not ``ValueError`` or ``NotCompiledError``).
        RuntimeError: rank 0's search raised anything else.
    """
    while True:
        message = _broadcast(None)
        kind, rest = message[0], message[1:]
        if kind == "check":
            setting, text = tuple(rest[0]), rest[1]
            try:
                checked_together(setting, text, functools.partial(_check_json, check, setting, text))
            except CheckFailed:
                pass  # rank 0 logs it and goes on
        elif kind == "plan":
            return Plan.from_json(rest[0])
        elif kind == "infeasible":
            raise InfeasibleBudgetError(*rest)
        elif kind == "unfaithful":
            raise InfeasibleFidelityError(*rest)
        else:
            raise RuntimeError(f"sh.plan: rank 0's search raised {rest[0]}")
