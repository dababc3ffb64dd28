"""Codecs work on a 2-D ``(rows, cols)`` view of a saved tensor in *memory* order.

The innermost dim in memory becomes ``cols``. For any dense tensor, transposed
or channels_last included, that view needs no copy, and :func:`from_rows` gives
back a tensor with the original strides by permuting back. Broadcast (stride-0)
dims are narrowed to one element first (:func:`narrow_broadcast`) and expanded
back on decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks._torch.tensors import is_non_overlapping_and_dense_or_false

__all__ = ["Layout", "blocks_view", "from_rows", "innermost_size", "is_broadcast", "memory_order", "narrow_broadcast", "to_rows"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How to turn a ``(rows, cols)`` result back into the saved tensor's shape and strides.

    Attributes:
        dims: the tensor's dims ordered outermost to innermost in memory.
        shape: the shape in that order (the shape of the contiguous permuted tensor).
        expand: the saved tensor's shape when it had broadcast (stride-0) dims,
            which were packed once and are expanded again; else ``()``.
    """

    dims: tuple[int, ...]
    shape: tuple[Any, ...]
    expand: tuple[Any, ...] = ()

    def as_constants(self) -> tuple[Any, ...]:
        """Plain tuples, as a pack result may carry them (torch bakes them into the unpack graph)."""
        return (self.dims, self.shape, self.expand)

    @classmethod
    def from_constants(cls, constants: tuple[Any, ...]) -> Layout:
        """Invert :meth:`as_constants`."""
        dims, shape, expand = constants
        return cls(tuple(dims), tuple(shape), tuple(expand))


def to_rows(x: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """View ``x`` as ``(rows, cols)`` in memory order (copying only if x is not dense).

    Args:
        x: any tensor (0-d included).

    Returns:
        ``(x2d, layout)``: x2d is contiguous; :func:`from_rows` inverts it.
    """
    if x.dim() == 0:
        return x.reshape(1, 1), Layout((), ())
    expand: tuple[Any, ...] = ()
    if is_broadcast(x):
        # broadcast dims (expanded K/V in grouped-query attention): pack the data once
        expand = tuple(x.shape)
        x = narrow_broadcast(x)
    dims = memory_order(x)
    permuted = x if dims == tuple(range(x.dim())) else x.permute(dims)
    permuted = permuted.contiguous()  # a no-op for dense tensors
    return permuted.view(-1, permuted.shape[-1]), Layout(dims, tuple(permuted.shape), expand)


def is_broadcast(x: torch.Tensor) -> bool:
    """Whether ``x`` has a broadcast dim (stride 0, size above 1), e.g. from ``expand``.

    Args:
        x: any tensor.

    Returns:
        True when some elements of ``x`` share memory.
    """
    return any(stride == 0 and size != 1 for size, stride in zip(x.shape, x.stride()))


def narrow_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Narrow every broadcast (stride-0) dim of ``x`` to size 1: the data it really holds.

    Args:
        x: any tensor.

    Returns:
        A view of ``x``; ``.expand(x.shape)`` gives ``x`` back.
    """
    for dim, stride in enumerate(x.stride()):
        if stride == 0:  # narrow, not indexing: indexing sets a device guard (no CUDA on fake tensors)
            x = x.narrow(dim, 0, 1)
    return x


def memory_order(x: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``x`` from outermost to innermost in memory (logical order if x is not dense).

    Args:
        x: a tensor with at least one dim.

    Returns:
        A permutation of ``range(x.dim())``.
    """
    if x.is_contiguous() or not is_non_overlapping_and_dense_or_false(x):
        return tuple(range(x.dim()))
    # a dense permutation (transposed, channels_last): read it in memory order
    return tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d], d)))


def innermost_size(x: torch.Tensor) -> int:
    """Size of the innermost dim in memory (1 for 0-d tensors).

    Args:
        x: any tensor.

    Returns:
        The number of elements a row of :func:`to_rows` holds.
    """
    return x.shape[memory_order(x)[-1]] if x.dim() else 1


def from_rows(y: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Invert :func:`to_rows`: reshape ``(rows, cols)`` and permute back to the original strides.

    Args:
        y: contiguous tensor with the original number of elements (any 2-D view of
            the memory-order data, e.g. ``(rows, cols)`` or ``(-1, block)``).
        layout: what :func:`to_rows` returned for the original tensor.

    Returns:
        A view of ``y`` with the original shape (and strides, for dense tensors).
    """
    if not layout.dims:
        return y.reshape(())
    if layout.dims == tuple(range(len(layout.dims))):
        out = y.view(layout.shape)
    else:
        inverse = [0] * len(layout.dims)
        for position, dim in enumerate(layout.dims):
            inverse[dim] = position
        out = y.view(layout.shape).permute(inverse)
    return out.expand(layout.expand) if layout.expand else out


def blocks_view(rows: torch.Tensor, block_size: int, short_rows: bool = True) -> torch.Tensor:
    """``rows`` as ``(blocks, block_size)`` in memory order where the size allows, else as they are (a scale a row).

    A row a whole number of blocks wide goes through ``(rows, blocks, block_size)``:
    inductor indexes both views of a value affinely, where a flat reshape gives
    ``(block * b + i) % cols``, which it leaves unsimplified (a fused kernel then
    loads its input one lane at a time). Otherwise blocks run on across the row
    ends (a block spans at most two rows) when the tensor's size is a multiple
    of ``block_size``: a row that ended in a short block would need a ``cat`` to
    join it back, which keeps inductor from fusing the decode into its consumer.

    Args:
        rows: a 2-D tensor, rows contiguous (:func:`to_rows`).
        block_size: values per block.
        short_rows: rows narrower than a block run on across their ends too
            (False: such rows keep a scale each).

    Returns:
        A 2-D view (or reshape) of the same values in the same order.
    """
    if rows.shape[1] % block_size == 0:
        return rows.view(rows.shape[0], rows.shape[1] // block_size, block_size).view(-1, block_size)
    if (short_rows or rows.shape[1] > block_size) and rows.numel() % block_size == 0:
        return rows.reshape(-1, block_size)
    return rows
