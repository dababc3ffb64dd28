"""Concrete byte counts for tensors whose sizes may be symbolic (``dynamic=True``).

The memory model, the scratch model and the offload placement compare sizes and
times as plain numbers: a symbolic size is read through its hint (the value seen
when the graph was traced), never guarded on.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["size_hint", "tensor_nbytes"]


def size_hint(size: Any) -> int:
    """An int, or a SymInt's hint.

    Args:
        size: an ``int`` or a ``torch.SymInt``.

    Returns:
        The value, or the symbol's hint from its shape environment.

    Raises:
        Nothing.
    """
    if isinstance(size, int):
        return size
    node = size.node
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else int(node.shape_env.size_hint(node.expr))


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its storage), with symbolic sizes read through their hints.

    Args:
        t: a tensor, real, fake or functional.

    Returns:
        ``numel * element_size`` as an int.

    Raises:
        Nothing.
    """
    return size_hint(t.numel()) * t.element_size()
