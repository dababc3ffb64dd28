"""Train under ``transformers.Trainer`` with savedhooks: hooks around every training forward, or a plan.

::

    from savedhooks.integrations.transformers import PlanOnFirstBatch, SavedHooksTrainer

    trainer = SavedHooksTrainer(model=model, args=args, train_dataset=data, savedhooks=sh.policy())
    trainer = SavedHooksTrainer(model=model, args=args, train_dataset=data,
                                savedhooks=PlanOnFirstBatch(fraction=0.7))

:class:`SavedHooksMixin` does the work for any ``Trainer`` subclass (TRL's
trainers, a user's own): ``class MyTrainer(SavedHooksMixin, SFTTrainer)``.

* **Where the hooks are.** Around :meth:`Trainer.training_step`, which runs
  the forward and the backward of one micro-batch: every micro-batch of a
  gradient accumulation packs its saved tensors. Evaluation and prediction
  (``evaluate``, ``predict``, ``prediction_step``) run without them.
* **Compiled or not.** With ``TrainingArguments(torch_compile=True)`` the
  Trainer compiles the model (through accelerate) on its first call, inside
  the hooks: they are inlined into the compiled graphs as under a plain
  ``torch.compile``. Without it they run eagerly.
* **A plan.** :class:`PlanOnFirstBatch` makes an :func:`savedhooks.plan` on
  the first training batch (moved to the device as the Trainer moves it), for
  ``budget_bytes`` or a ``fraction`` of the planner's modelled peak without
  hooks, with the model's own loss (``outputs.loss``, what the Trainer
  trains). Planning runs compiled steps of its own: it restores the random
  number generators after it (the training run draws the same dropout masks
  as without a plan), leaves the parameters and gradients as they were, and
  applies the plan (:meth:`savedhooks.Plan.apply`: the blocks it recomputes,
  ``use_cache=False``); :meth:`~SavedHooksMixin.train` reverts it when
  training ends. The plan is made for that batch's shapes; at others (a
  smaller last batch, longer sequences) it applies its choices per saved-tensor
  role and keeps its share of the peak without hooks
  (:class:`savedhooks.planner.Planned`, ``docs/integrations.md``).
  The plan is kept as ``trainer.savedhooks_plan``.

This module imports ``transformers``; ``import savedhooks`` does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import transformers

from savedhooks.compiler.api import saved_tensors_hooks
from savedhooks.hooks import HookPair
from savedhooks.planner import Plan
from savedhooks.planner.driver import Planner

__all__ = ["PlanOnFirstBatch", "SavedHooksMixin", "SavedHooksTrainer"]


def _model_loss(outputs: Any) -> torch.Tensor:
    """The loss a transformers model returns when its inputs carry labels (``outputs.loss`` or ``outputs[0]``)."""
    loss = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "PlanOnFirstBatch: the model returned no scalar loss for the first batch (does the batch carry "
            "labels?); pass loss_fn= to turn its output into the training loss"
        )
    return loss


@dataclasses.dataclass(frozen=True)
class PlanOnFirstBatch:
    """Plan the saved tensors for a byte budget on the first training batch (see the module notes).

    Give exactly one of ``budget_bytes`` and ``fraction``.

    Attributes:
        budget_bytes: the activation peak to meet, in bytes above what is
            alive before the step (as :func:`savedhooks.plan` counts it).
        fraction: the budget as a fraction of the planner's modelled peak of
            the compiled step without hooks (:attr:`Planner.baseline_bytes`), in (0, 1].
        loss_fn: turns the model's output into the loss the Trainer trains;
            default: ``outputs.loss`` (the model's own loss from ``labels``).
            A Trainer with ``compute_loss_func`` computes another loss: pass
            the same function here (on the output only).
        plan_kwargs: further keyword arguments of :class:`Planner` /
            :func:`savedhooks.plan` (``blocks``, ``min_sqnr_db``, ``check``, ...).
    """

    budget_bytes: int | None = None
    fraction: float | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    plan_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.budget_bytes is None) == (self.fraction is None):
            raise ValueError("PlanOnFirstBatch: give exactly one of budget_bytes= and fraction=")
        if self.budget_bytes is not None and (isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0):
            raise ValueError(f"PlanOnFirstBatch: budget_bytes must be a positive int, got {self.budget_bytes!r}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"PlanOnFirstBatch: fraction must be in (0, 1], got {self.fraction!r}")
        unknown = set(self.plan_kwargs) - {"backend", "seed", "blocks", "min_sqnr_db", "check", "output_held"}
        if unknown:
            raise ValueError(f"PlanOnFirstBatch: plan_kwargs has arguments sh.plan does not take: {sorted(unknown)}")

    def make(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Plan:
        """Plan ``model`` (not compiled) for ``inputs``, restoring the random number generators after.

        Args:
            model: the module the Trainer trains, unwrapped and not compiled.
            inputs: one training batch on the model's device.

        Returns:
            The plan (not applied).

        Raises:
            savedhooks.InfeasibleBudgetError: the budget is below the lowest
                peak the planner reaches (its message names the budget to pass).
            ValueError: the model returns no scalar loss for the batch.
        """
        kwargs = dict(self.plan_kwargs)
        planner_kwargs = {k: kwargs.pop(k) for k in ("backend", "seed", "blocks", "min_sqnr_db") if k in kwargs}
        cuda = {t.device for t in inputs.values() if torch.is_tensor(t) and t.device.type == "cuda"}
        devices = sorted({torch.cuda.current_device() if d.index is None else d.index for d in cuda})
        with torch.random.fork_rng(devices=devices):
            planner = Planner(model, inputs, loss_fn=self.loss_fn or _model_loss, **planner_kwargs)
            budget = self.budget_bytes or max(1, int(self.fraction * planner.baseline_bytes))
            return planner.plan(budget, check=kwargs.pop("check", None))


class SavedHooksMixin:
    """Mix into a ``transformers.Trainer`` class: saved-tensor hooks around every training step.

    ``class MyTrainer(SavedHooksMixin, SomeTrainer)``; the mixin comes first.
    Its constructor takes one more keyword, ``savedhooks``: a hook pair
    (``sh.policy()``, ``sh.fp8()``, ``plan.hooks``), a :class:`PlanOnFirstBatch`,
    or None (train as the Trainer does). See the module notes.

    Attributes:
        savedhooks: what the constructor was given.
        savedhooks_plan: the plan made on the first batch (None before it, or without a plan).
    """

    def __init__(self, *args: Any, savedhooks: HookPair | PlanOnFirstBatch | None = None, **kwargs: Any) -> None:
        if savedhooks is not None and not isinstance(savedhooks, (HookPair, PlanOnFirstBatch)):
            raise TypeError(
                "savedhooks= takes a hook pair (sh.policy(), sh.fp8(), plan.hooks), a PlanOnFirstBatch or None, "
                f"got {type(savedhooks).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.savedhooks = savedhooks
        self.savedhooks_plan: Plan | None = None
        self._savedhooks_applied_to: torch.nn.Module | None = None

    def _savedhooks_pair(self, model: torch.nn.Module, inputs: dict[str, Any]) -> HookPair | None:
        if not isinstance(self.savedhooks, PlanOnFirstBatch):
            return self.savedhooks
        module = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        if self.savedhooks_plan is None:
            grads = {name: p.grad for name, p in module.named_parameters()}
            self.savedhooks_plan = self.savedhooks.make(module, self._prepare_inputs(dict(inputs)))
            for name, p in module.named_parameters():  # as they were before the planner's steps
                p.grad = grads[name]
        if self._savedhooks_applied_to is None:  # the first step, or the first of another train()
            self.savedhooks_plan.apply(module)
            self._savedhooks_applied_to = module
        return self.savedhooks_plan.hooks

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's training step (forward and backward of one micro-batch) inside the hooks.

        The first call with a :class:`PlanOnFirstBatch` makes the plan on its batch and applies it.
        """
        pair = self._savedhooks_pair(model, inputs)
        if pair is None:
            return super().training_step(model, inputs, *args, **kwargs)
        with saved_tensors_hooks(pair):
            return super().training_step(model, inputs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; a plan applied on the first batch is reverted when it returns or raises."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.savedhooks_plan is not None and self._savedhooks_applied_to is not None:
                self.savedhooks_plan.revert(self._savedhooks_applied_to)
                self._savedhooks_applied_to = None


class SavedHooksTrainer(SavedHooksMixin, transformers.Trainer):
    """``transformers.Trainer`` with :class:`SavedHooksMixin`: pass ``savedhooks=`` (see the module notes)."""
