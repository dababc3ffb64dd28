"""Tensor internals: version counters, views, storages, fake and functional tensor types, layouts.

The hooks check that a saved tensor was not modified in place by reading its
version counter (``Tensor._version``), look through views to their base
(``Tensor._base``), key tensors by storage, and tell real tensors from the
``FakeTensor`` / ``FunctionalTensor`` subclasses AOTAutograd traces with. These
live under private names in torch 2.13 (``torch._subclasses``,
``torch._prims_common``); this module names them once.
"""

from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false, make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "base_of",
    "is_non_overlapping_and_dense_or_false",
    "is_traced",
    "is_view",
    "make_contiguous_strides_for",
    "storage_cdata",
    "unset_fake_temporarily",
    "version_counter",
]


def version_counter(t: torch.Tensor) -> int:
    """The tensor's version counter, which every in-place change of its storage increments.

    Args:
        t: a tensor.

    Returns:
        ``t._version``.
    """
    return t._version


def is_view(t: torch.Tensor) -> bool:
    """Whether the tensor is a view of another (autograd's view tracking).

    Args:
        t: a tensor.

    Returns:
        ``t._is_view()``.
    """
    return t._is_view()


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from.

    Args:
        t: a tensor.

    Returns:
        ``t._base``: the base of a view, None for a tensor that is not one.
    """
    return t._base


def storage_cdata(t: torch.Tensor) -> int:
    """The address of the C++ storage object behind the tensor (an identity for the storage, not its data).

    Args:
        t: a tensor with a storage.

    Returns:
        ``t.untyped_storage()._cdata``.

    Raises:
        NotImplementedError, RuntimeError: the tensor has no storage (sparse tensors, some wrappers).
    """
    return t.untyped_storage()._cdata


def is_traced(t: torch.Tensor) -> bool:
    """Whether the tensor is one of the subclasses AOTAutograd traces with (fake or functional).

    Args:
        t: a tensor.

    Returns:
        True for a ``FakeTensor`` or a ``FunctionalTensor``.
    """
    return isinstance(t, (FakeTensor, FunctionalTensor))
