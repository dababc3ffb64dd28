"""Operator internals: overload types, schemas, Python dispatch modes and custom ops' dispatch rules.

``torch._ops.OpOverload`` / ``OpOverloadPacket`` are the types of
``torch.ops.<ns>.<op>[.<overload>]``; an overload's schema (which arguments it
writes, how many values it returns) is its ``_schema``. Dispatch modes
(``TorchDispatchMode``) live in ``torch.utils._python_dispatch``. A custom op's
per-mode rules are in ``CustomOpDef._torch_dispatch_fns``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = [
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "current_dispatch_mode",
    "schema_of",
    "schema_or_none",
    "torch_dispatch_rule",
]


def schema_of(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an operator overload.

    Args:
        op: an ``OpOverload`` such as ``torch.ops.aten.add_.Tensor``.

    Returns:
        ``op._schema``: its arguments (with alias and write information) and returns.
    """
    return op._schema


def schema_or_none(target: Any) -> torch.FunctionSchema | None:
    """The schema of an FX node's call target when it has one (an operator overload), else None.

    Args:
        target: a ``call_function`` node's target: an ``OpOverload``, a Python function, a builtin.

    Returns:
        ``target._schema``, or None for a target without one.
    """
    return getattr(target, "_schema", None)


def current_dispatch_mode() -> TorchDispatchMode | None:
    """The innermost Python dispatch mode active on this thread.

    Returns:
        The mode, or None when none is active.
    """
    return _get_current_dispatch_mode()


def torch_dispatch_rule(op: Any, mode: type) -> Any:
    """The rule a custom op has registered for a dispatch mode (``register_torch_dispatch``).

    Args:
        op: a ``torch.library.CustomOpDef`` (as ``torch.library.triton_op`` returns).
        mode: the mode's type, e.g. ``FunctionalTensorMode``.

    Returns:
        The rule: a callable ``(mode, func, types, args, kwargs)``.

    Raises:
        KeyError: the op has no rule for ``mode``.
    """
    return op._torch_dispatch_fns[mode]
