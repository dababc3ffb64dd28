"""Planning: meet a peak-memory budget by choosing which blocks to recompute and, per saved tensor, how it is held.

Reads :mod:`savedhooks.memory` (the step's timeline) and produces checkpoint
choices (:meth:`Plan.apply`: ``torch.utils.checkpoint`` per block) and codec
choices (:class:`Plan`, run with ``sh.saved_tensors_hooks(plan.hooks)``).
Offload (to pinned host memory) is a choice for tensors on a GPU.
"""

from savedhooks.planner.api import plan
from savedhooks.planner.driver import Planner
from savedhooks.planner.recompute import find_blocks
from savedhooks.planner.result import InfeasibleBudgetError, InfeasibleFidelityError, Plan, Planned, PlannedTensor
from savedhooks.planner.survey import NotCompiledError, Survey, survey

__all__ = ["InfeasibleBudgetError", "InfeasibleFidelityError", "NotCompiledError", "Plan", "Planned", "PlannedTensor", "Planner", "Survey",
           "find_blocks", "plan", "survey"]
