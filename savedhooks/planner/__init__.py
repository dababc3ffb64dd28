"""Planning: meet a peak-memory budget by choosing, per saved tensor, how it is held.

Reads :mod:`savedhooks.memory` (the step's timeline) and produces codec choices
(:class:`Plan`, run with ``sh.saved_tensors_hooks(plan.hooks)``). First slice:
codecs only; recompute and offload are not chosen yet.
"""

from savedhooks.planner.plan import InfeasibleBudgetError, Plan, Planned, PlannedTensor, Survey, plan, survey

__all__ = ["InfeasibleBudgetError", "Plan", "Planned", "PlannedTensor", "Survey", "plan", "survey"]
