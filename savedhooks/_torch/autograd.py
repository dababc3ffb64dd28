"""Autograd graph internals: what a node saved, read without unpacking it.

An eager-mode codec that must know which op reads a saved tensor finds the
nodes that saved it: a built-in node exposes each saved variable as a
``_raw_saved_<name>`` attribute (a ``torch._C._autograd.SavedTensor``, or a
list of them), a custom ``autograd.Function``'s node as ``_raw_saved_tensors``;
``SavedTensor.data`` is the payload the pack hook returned, not unpacked. A
``pow`` node keeps its scalar exponent as ``_saved_exponent``. torch 2.11
through 2.14 name these the same.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_custom_function_node", "named_payloads", "saved_exponent"]

_SAVED_PREFIX = "_raw_saved_"
_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def named_payloads(node: Any) -> list[tuple[str, Any]]:
    """What a node's saved variables hold: the pack hooks' payloads, never unpacked.

    Args:
        node: an autograd node (``tensor.grad_fn`` and the nodes behind it).

    Returns:
        ``(name, payload)`` per saved variable, ``name`` the variable's name
        (``"query"``, ``"self"``; ``"tensors"`` for a custom function's), the
        payload that the pack hook returned, or the tensor itself where no
        hook packed it; a variable released by a backward or never set is
        left out.
    """
    names = _ATTRIBUTES.get(type(node))
    if names is None:
        names = _ATTRIBUTES[type(node)] = tuple(a for a in dir(node) if a.startswith(_SAVED_PREFIX))
    payloads = []
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # released after a backward, or an undefined optional tensor
            continue
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            try:
                payloads.append((name[len(_SAVED_PREFIX) :], saved.data))
            except (AttributeError, RuntimeError):
                continue
    return payloads


def saved_exponent(node: Any) -> Any:
    """The scalar exponent a ``pow`` node saved (``PowBackward0``), or None where it has none."""
    return getattr(node, "_saved_exponent", None)


def is_custom_function_node(node: Any) -> bool:
    """Whether ``node`` is the backward node of a custom ``torch.autograd.Function``."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)
