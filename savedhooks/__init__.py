"""savedhooks: cheaper activation memory through saved-tensor hooks, eager and compiled."""

from savedhooks import fidelity, memory, schedule
from savedhooks.codecs import (
    Bitmask,
    Centered,
    Codec,
    Downcast,
    Float8,
    Offload,
    Policy,
    bitmask,
    downcast,
    fp8,
    offload,
    policy,
)
from savedhooks.compilers import backend, reorder_pass, saved_tensors_hooks
from savedhooks.fidelity import sensitivity
from savedhooks.hooks import (
    HookContext,
    HookError,
    HookMismatchError,
    HookMutationError,
    HookPair,
    HookTypeError,
    PackHook,
    hook,
    hook_context,
    make_hook_pair,
)
from savedhooks.identity import UnfingerprintableError, fingerprint
from savedhooks.metrics import sqnr
from savedhooks.planner import InfeasibleBudgetError, InfeasibleFidelityError, Plan, plan

__version__ = "0.1.0"

__all__ = [
    # hooks: build a pair, apply it
    "HookPair",
    "PackHook",
    "hook",
    "make_hook_pair",
    "saved_tensors_hooks",
    "HookContext",
    "hook_context",
    # codecs: ready-made hook pairs, and their configurations
    "fp8",
    "downcast",
    "bitmask",
    "offload",
    "policy",
    "Codec",
    "Float8",
    "Downcast",
    "Bitmask",
    "Centered",
    "Offload",
    "Policy",
    # placing hooks under torch.compile
    "backend",
    "reorder_pass",
    # fitting a budget
    "plan",
    "Plan",
    "InfeasibleBudgetError",
    "InfeasibleFidelityError",
    # measuring
    "memory",
    "schedule",
    "sqnr",
    "fidelity",
    "sensitivity",
    # errors
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookTypeError",
    "UnfingerprintableError",
    # identity of hook code across processes
    "fingerprint",
]
