"""savedhooks: cheaper activation memory through saved-tensor hooks, eager and compiled."""

from savedhooks.fingerprint import UnfingerprintableError, fingerprint
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
    saved_tensors_hooks,
)

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
    # errors
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookTypeError",
    "UnfingerprintableError",
    # identity of hook code across processes
    "fingerprint",
]
