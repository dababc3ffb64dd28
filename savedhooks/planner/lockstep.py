"""Checks in lockstep under ``torch.distributed``: rank 0 decides which plans to check, every rank checks them.

Design notes
------------
* A check (:mod:`savedhooks.planner.check`) compiles the model and runs one
  training step. Under FSDP2 or DDP that step runs collectives, so every rank
  must run the same checks in the same order. Each rank's own search would not
  do that: which plans a rank checks depends on its peaks and on the codec and
  recompute times it measured (seen before this module: gloo's "collective
  mismatch" abort under FSDP2).
* So rank 0 leads: before each check it broadcasts the plan (JSON) and the
  recompute setting; every rank checks that plan on its own step; the checked
  peak is the highest over the ranks (all-reduce max), so a plan that meets
  the budget meets it on every rank. When rank 0's search ends it broadcasts
  its plan, or its error, and every rank returns or raises the same.
* The surveys before it already run in lockstep: every rank surveys the same
  recompute settings in the same order, one step each.
* A check that raises on any rank raises :class:`CheckFailed` on every rank
  (the flag travels with the peak), so the ranks leave it together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from savedhooks.planner.result import InfeasibleBudgetError, Plan

__all__ = ["CheckFailed", "checked_together", "follow", "is_leader", "lead", "several"]

Setting = tuple[int, str]


class CheckFailed(ValueError):
    """A plan's check raised on some rank; every rank raises this."""


def several() -> bool:
    """Whether ``torch.distributed`` runs several processes in its default group.

    Args:
        None.

    Returns:
        True with an initialized default group of more than one process.

    Raises:
        Nothing.
    """
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_leader() -> bool:
    """Whether this process decides (rank 0, or the only process).

    Args:
        None.

    Returns:
        True on rank 0 or without several processes.

    Raises:
        Nothing.
    """
    return not several() or torch.distributed.get_rank() == 0


def _broadcast(message: object) -> object:
    """Rank 0's ``message`` on every rank."""
    box = [message]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def checked_together(setting: Setting, plan: Plan, check: Callable[[Setting, Plan], int]) -> int:
    """Check ``plan`` on every rank: rank 0 announces it, each rank checks, the highest peak wins.

    Args:
        setting: the plan's recompute setting ``(k, mode)``.
        plan: the plan to check (rank 0's; the other ranks pass what they got).
        check: this rank's check of a plan (one compile and step).

    Returns:
        The highest checked peak over the ranks.

    Raises:
        CheckFailed: the check raised on some rank.
    """
    if is_leader():
        _broadcast(("check", setting, plan.to_json()))
    try:
        peak, failed = check(setting, plan), 0
    except Exception as error:  # noqa: BLE001  the other ranks must still meet this one in the all-reduce
        peak, failed, why = 0, 1, error
    flags = torch.tensor([peak, failed], dtype=torch.int64)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    if flags[1]:
        raise CheckFailed(f"the check raised on a rank ({why if failed else 'another rank'})")
    return int(flags[0])


def lead(decide: Callable[[], Plan]) -> Plan:
    """Rank 0: run the planner's search (its checks announce themselves), then send its plan or error.

    Args:
        decide: the search with its checks.

    Returns:
        The plan ``decide`` returned.

    Raises:
        Whatever ``decide`` raises, after sending it to the other ranks.
    """
    try:
        plan = decide()
    except InfeasibleBudgetError as error:
        _broadcast(("infeasible", error.budget_bytes, error.floor_bytes, error.baseline_bytes, error.checked))
        raise
    except Exception as error:
        _broadcast(("error", f"{type(error).__name__}: {error}"))
        raise
    _broadcast(("plan", plan.to_json()))
    return plan


def follow(check: Callable[[Setting, Plan], int]) -> Plan:
    """Every rank but 0: check what rank 0 announces until it sends its plan or error.

    Args:
        check: this rank's check of a plan (one compile and step).

    Returns:
        Rank 0's plan.

    Raises:
        InfeasibleBudgetError: rank 0's search found the budget infeasible.
        RuntimeError: rank 0's search raised anything else.
    """
    while True:
        message = _broadcast(None)
        kind, rest = message[0], message[1:]
        if kind == "check":
            setting, text = rest
            try:
                checked_together(tuple(setting), Plan.from_json(text), check)
            except CheckFailed:
                pass  # rank 0 logs it and goes on
        elif kind == "plan":
            return Plan.from_json(rest[0])
        elif kind == "infeasible":
            raise InfeasibleBudgetError(*rest)
        else:
            raise RuntimeError(f"sh.plan: rank 0's search raised {rest[0]}")
