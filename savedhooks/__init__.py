"""savedhooks: cheaper activation memory through saved-tensor hooks, eager and compiled.

The top level holds what a training script calls: the hooks block, the codecs
(as factories returning a :class:`HookPair`), ``@hook`` for hooks of one's own,
the planner, the ``torch.compile`` backend and the errors. Their configuration
classes and the tools live in submodules: :mod:`savedhooks.codecs` (``Float8``,
``Policy``, ...), :mod:`savedhooks.memory` (predicting and measuring peaks),
:mod:`savedhooks.fidelity` (SQNR, sensitivity), :mod:`savedhooks.schedule`,
:mod:`savedhooks.compiler` (``reorder_pass``), :mod:`savedhooks.hooks` (the hook
core and its fingerprints).
"""

from savedhooks import codecs, compiler, fidelity, hooks, memory, schedule  # noqa: F401  (submodules: sh.memory, ...)
from savedhooks.codecs import bitmask, downcast, fp8, offload, policy
from savedhooks.compiler import backend, saved_tensors_hooks
from savedhooks.hooks import (
    HookContext,
    HookError,
    HookMismatchError,
    HookMutationError,
    HookPair,
    HookTypeError,
    UnfingerprintableError,
    hook,
    hook_context,
)
from savedhooks.planner import InfeasibleBudgetError, InfeasibleFidelityError, Plan, plan

__version__ = "0.1.0"

__all__ = [
    # apply hooks to the tensors saved for backward
    "saved_tensors_hooks",
    "HookPair",
    "hook",
    "hook_context",
    "HookContext",
    # codecs: ready-made hook pairs
    "fp8",
    "downcast",
    "bitmask",
    "offload",
    "policy",
    # fitting a budget
    "plan",
    "Plan",
    # placement without inductor
    "backend",
    # errors
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookTypeError",
    "UnfingerprintableError",
    "InfeasibleBudgetError",
    "InfeasibleFidelityError",
]
