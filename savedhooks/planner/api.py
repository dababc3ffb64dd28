"""``sh.plan``: one budget, planned by a :class:`~savedhooks.planner.driver.Planner` made for the call.

The planner's design notes are in :mod:`savedhooks.planner.driver`; keep a
``Planner`` to plan several budgets without surveying again. Within the
package, this module is the only one that imports the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from savedhooks.planner.driver import Planner
from savedhooks.planner.result import Plan, check_budget

__all__ = ["plan"]


def plan(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    budget_bytes: int,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backend: str = "inductor",
    seed: int = 0,
    verbose: bool = False,
    blocks: Sequence[str] | None = None,
    min_sqnr_db: float | None = None,
    check: bool | None = None,
    output_held: bool = False,
) -> Plan:
    """Choose which blocks to recompute (whole or selectively) and, per saved tensor, keep / bf16 / fp8 / bitmask / offload.

    The choice meets ``budget_bytes`` at the least modelled time (codecs and
    recompute). A :class:`Planner`'s :meth:`~Planner.plan`: per recompute
    setting one compile and training step (the survey; parameters unchanged),
    the search, then with ``check`` one compile and step per plan checked.
    What ``sh.policy()`` keeps for fidelity stays kept; with ``min_sqnr_db``
    the plan's predicted gradient SQNR meets it. Offload (to pinned host
    memory) is a choice on a GPU only (not yet run on one). To plan several
    budgets, keep a :class:`Planner`. Each survey ends with
    ``torch.compiler.reset()``: plan before compiling anything else.

    Every argument after ``example_inputs`` is keyword-only.

    Args:
        model: the module to train (not compiled: the plan compiles it). A
            transformers model plans and trains with its configs'
            ``use_cache`` off (:mod:`savedhooks.planner.caches`), as
            transformers' own gradient checkpointing trains.
        example_inputs: a tuple of positional arguments, a dict of keyword
            arguments, or one tensor, of the shapes training uses.
        budget_bytes: the peak to meet, in bytes above what is alive before the
            step (parameters, inputs, optimizer state excluded), as the memory
            model predicts it for the compiled graphs with placement.
        loss_fn: turns the model's output into a scalar (run eagerly, as in a
            training loop); default: the output if it is a scalar, else the mean
            square of its floating tensors.
        backend: ``"inductor"`` (plain ``torch.compile``) or ``"aot_eager"``
            (run the plan with ``sh.backend("aot_eager")``); the plan's keys are
            those of this backend's graphs.
        seed: ``torch.manual_seed`` before each step.
        verbose: print the report.
        blocks: module paths of the blocks the plan may recompute, in forward
            order; default: the children of the model's largest
            ``nn.ModuleList`` of one class (:func:`~savedhooks.planner.recompute.find_blocks`);
            ``()``: codecs only.
        min_sqnr_db: None, or the least worst parameter-gradient SQNR (dB)
            the plan may be predicted at: runs :func:`savedhooks.fidelity.sensitivity`
            (fp8) once first (``2 + 2 * groups`` compiled steps;
            :mod:`savedhooks.planner.fidelity`), prices each lossy choice by
            the gradient noise it adds (the noises add up), and meets the
            limit at the least time (bf16 or keep instead of fp8, or more
            recompute); ``plan.predicted_sqnr_db`` is the prediction. With
            ``check`` in one process, each checked plan's gradients are
            measured too (``plan.checked_sqnr_db``) and one below the limit is not kept.
        check: check plans on the graphs compiled with their own hooks (one
            compile and step each; the module notes; ``predicted_peak_bytes``
            is then the checked peak). ``False``: the survey's model alone,
            blind to how the hooks change the compiled graphs. ``None``
            (default): check. Under ``torch.distributed`` with several
            processes every rank checks together and gets rank 0's plan
            (:mod:`savedhooks.planner.lockstep`): every rank must call it,
            with the same arguments; with ``False`` each rank plans alone.
        output_held: whether the training loop keeps the model's output to
            the end of the step (``out = model(x)``, then
            ``loss_fn(out).backward()``). ``False`` (default): the loop hands
            it to the loss and drops it (``loss_fn(model(x)).backward()``),
            so it is freed once the loss no longer needs it (after a
            cross-entropy's forward). A loop that keeps it holds it next to
            its gradient in the backward: planned with ``False``, it can peak
            above the prediction by up to the output's bytes.

    Returns:
        A :class:`Plan`: run it with ``plan.apply(model)`` (the recompute),
        then ``torch.compile`` inside ``sh.saved_tensors_hooks(plan.hooks)``.

    Raises:
        TypeError: an option passed by position, ``model`` is not a module, ``budget_bytes`` not an int,
            ``blocks`` a string, ``min_sqnr_db`` not a number, ``check``
            not a bool or None, ``output_held`` not a bool, or ``loss_fn``
            returns other than a floating tensor.
        ValueError: ``model`` is compiled already, ``budget_bytes`` is not
            positive, ``backend`` is unknown, a block path names no submodule,
            ``min_sqnr_db`` is not finite, the output has no floating tensor
            and no ``loss_fn``, the loss is not a scalar, the model raises on
            ``example_inputs`` (one eager forward checks them; the model's
            error is the cause), ``example_inputs`` ask for a KV cache
            (``use_cache=True``), or the model has blocks checkpointed by a
            plan's ``apply`` (revert it first).
        NotCompiledError: the model did not compile (dynamo ran it eagerly).
        InfeasibleBudgetError: the budget is below the lowest peak reachable
            (the error names it: with ``check``, the lowest checked peak where
            a plan was checked, else the modelled floor), or, with ``check``,
            every plan checked peaks above it.
        InfeasibleFidelityError: (``min_sqnr_db``) every plan meeting the
            budget is predicted (or, checked, measured) below it; the error
            names the best figure.
        RuntimeError: (several processes, with ``check``) rank 0's search
            raised (that rank raises the error itself), or a check raised
            other than ``ValueError`` / ``NotCompiledError`` on some rank
            (:class:`~savedhooks.planner.lockstep.ChecksAborted`, on every rank).
    """
    check_budget(budget_bytes)
    planner = Planner(model, example_inputs, loss_fn=loss_fn, backend=backend, seed=seed, blocks=blocks,
                      min_sqnr_db=min_sqnr_db, output_held=output_held)  # fmt: skip
    return planner.plan(budget_bytes, verbose=verbose, check=check)
