"""The hook core: hook pairs that eager autograd and AOTAutograd both run.

* :mod:`savedhooks.hooks.pair`: :class:`HookPair`, ``@hook`` and the registry
  of pairs that compiled graphs call;
* :mod:`savedhooks.hooks.contract`: what a pack and an unpack may do, checked
  while they run (:func:`hook_context`, the error types);
* :mod:`savedhooks.hooks.eager`: the trampolines the hook graphs call and the
  eager-mode rules (per-step caches, held tensors);
* :mod:`savedhooks.hooks.identity`: fingerprints that make a hook's identity
  stable across processes (the compile caches key on them).

Nothing here knows codecs or the compile passes: those layers build on this one.
"""

from savedhooks.hooks.identity import UnfingerprintableError
from savedhooks.hooks.pair import (
    HookContext,
    HookError,
    HookMismatchError,
    HookMutationError,
    HookPair,
    HookTypeError,
    PackHook,
    applied,
    check_hook_pair,
    eager_largest_saved,
    eager_readers,
    eager_saved_as,
    eager_savers,
    hook,
    hook_context,
    make_hook_pair,
)

__all__ = [
    "HookContext",
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookPair",
    "HookTypeError",
    "PackHook",
    "UnfingerprintableError",
    "applied",
    "check_hook_pair",
    "eager_largest_saved",
    "eager_readers",
    "eager_saved_as",
    "eager_savers",
    "hook",
    "hook_context",
    "make_hook_pair",
]
