"""Concrete byte counts for tensors whose sizes may be symbolic (``dynamic=True``), and storage identity.

The memory model, the scratch model and the offload placement compare sizes and
times as plain numbers: a symbolic size is read through its hint (the value seen
when the graph was traced), never guarded on. They, the planner's census and the
codecs' placement rule also ask which values share a storage: one key for that
(:func:`storage_key`).
"""

from __future__ import annotations

from typing import Any

import torch

from savedhooks._torch import pytree
from savedhooks._torch.tensors import storage_cdata

__all__ = [
    "CUDA_BLOCK_BYTES",
    "allocated_bytes",
    "float_hint",
    "size_hint",
    "storage_key",
    "tensor_nbytes",
    "tensor_storages",
]

CUDA_BLOCK_BYTES = 512  # CUDA's caching allocator rounds every block up to a multiple of this (kMinBlockSize)


def _hint(value: Any) -> Any:
    """A ``SymInt``'s or ``SymFloat``'s value at its symbols' hints (the traced values), without a guard."""
    node = value.node
    hint = getattr(node, "hint", None)
    return hint if hint is not None else node.shape_env.size_hint(node.expr)


def size_hint(size: Any) -> int:
    """An int, or a SymInt's hint.

    Args:
        size: an ``int`` or a ``torch.SymInt``.

    Returns:
        The value, or the symbol's hint from its shape environment.
    """
    return size if isinstance(size, int) else int(_hint(size))


def float_hint(value: Any) -> float:
    """A number as a float; a ``SymInt``'s or ``SymFloat``'s hint, read without adding a guard.

    Args:
        value: an ``int``, a ``float``, a ``torch.SymInt`` or a ``torch.SymFloat``.

    Returns:
        The value, or the symbolic value at its symbols' hints.
    """
    return float(_hint(value) if isinstance(value, (torch.SymInt, torch.SymFloat)) else value)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its storage), with symbolic sizes read through their hints.

    Args:
        t: a tensor, real, fake or functional.

    Returns:
        ``numel * element_size`` as an int.
    """
    return size_hint(t.numel()) * t.element_size()


def storage_key(t: torch.Tensor) -> int | None:
    """What identifies ``t``'s storage: equal keys for tensors on one storage (views, aliases), real or fake.

    The storage's address, which is what ``StorageWeakRef`` compares storages by,
    without making a weak reference.

    Args:
        t: a tensor.

    Returns:
        An int key (it does not keep the storage alive; a freed storage's key
        may be reused), or None for a tensor without a storage (sparse, some
        wrappers).
    """
    try:
        return storage_cdata(t)
    except (NotImplementedError, RuntimeError):  # storage-less tensors
        return None


def allocated_bytes(nbytes: int, device: torch.device | str) -> int:
    """What an allocation of ``nbytes`` on ``device`` counts in its allocator's statistics.

    Args:
        nbytes: the bytes asked for.
        device: where.

    Returns:
        On CUDA, ``nbytes`` rounded up to :data:`CUDA_BLOCK_BYTES`, as
        ``torch.cuda.memory_allocated()`` counts blocks; elsewhere ``nbytes``.
    """
    if torch.device(device).type != "cuda":
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def tensor_storages(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) node value.

    Args:
        value: a tensor, a tuple/list/dict of them, or anything else.

    Returns:
        The tensor leaves, in pytree order.
    """
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
