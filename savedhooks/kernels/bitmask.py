"""Bool tensors packed 8 per byte, small integers packed ``8 / bits`` per byte: aten references and ops.

Bit ``i`` of byte ``j`` holds element ``8 * j + i`` of the flattened tensor
(little-endian within a byte); the last byte is zero-padded. The bit fields of
:func:`torch_bitfield_pack` generalize this: with ``bits`` per value, bits
``bits * i`` to ``bits * (i + 1) - 1`` of byte ``j`` hold value ``(8 / bits) * j + i``;
a bitmask is the 1-bit case, with the same bytes.
"""

from __future__ import annotations

import torch

__all__ = ["FIELD_BITS", "torch_bitfield_pack", "torch_bitfield_unpack", "torch_bitmask_pack", "torch_bitmask_unpack"]

# widths a byte holds a whole number of
FIELD_BITS = (1, 2, 4)


def check_pack_args(x: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is a bool tensor, 1-D or contiguous (shared with the Triton op).

    Its bits are packed in memory order: a contiguous tensor of any shape has
    one, a 1-D one of any stride is read in index order.
    """
    if x.dtype != torch.bool or (x.dim() > 1 and not x.is_contiguous()):
        raise ValueError(f"bitmask_pack expects a 1-D or a contiguous bool tensor, got {x.dtype}{tuple(x.shape)} "
                         f"with strides {tuple(x.stride())}")  # fmt: skip


def check_unpack_args(packed: torch.Tensor, numel: int) -> None:
    """Raise ValueError unless ``numel`` bools fit in the 1-D uint8 ``packed`` (shared with the Triton op)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or numel > 8 * packed.numel() or numel < 0:
        raise ValueError(f"bitmask_unpack: cannot unpack {numel} bools from {packed.dtype}{tuple(packed.shape)}")


def _field_shifts(bits: int, device: torch.device) -> torch.Tensor:
    """``bits * i`` for each field ``i`` of a byte, as uint8 (an ``arange``: no tensor constant in a traced graph)."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _check_bits(bits: int) -> None:
    if bits not in FIELD_BITS:
        raise ValueError(f"bit fields must be {FIELD_BITS} bits wide, got {bits!r}")


def torch_bitfield_pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of values below ``2 ** bits`` into ``ceil(n * bits / 8)`` bytes.

    Plain aten ops, traceable: inductor fuses them into the kernel that makes the values.
    Values at or above ``2 ** bits`` are not detected: they corrupt the fields
    above them (the caller knows the bound, e.g. a max pool's window size).

    Args:
        values: 1-D uint8 tensor, every value below ``2 ** bits``.
        bits: 1, 2 or 4.

    Returns:
        1-D uint8 tensor of ``ceil(values.numel() / (8 // bits))`` bytes.

    Raises:
        ValueError: values is not 1-D uint8, or ``bits`` is not 1, 2 or 4.
    """
    _check_bits(bits)
    if values.dtype != torch.uint8 or values.dim() != 1:
        raise ValueError(f"bitfield_pack expects a 1-D uint8 tensor, got {values.dtype}{tuple(values.shape)}")
    per = 8 // bits
    padded = torch.nn.functional.pad(values, (0, -values.numel() % per))
    # Fields never overlap, so a sum of shifted values is an OR; a uint8 sum stays uint8.
    return (padded.view(-1, per) << _field_shifts(bits, values.device)).sum(dim=1, dtype=torch.uint8)


def torch_bitfield_unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`torch_bitfield_pack`.

    Args:
        packed: 1-D uint8 tensor.
        bits: the width the values were packed with (1, 2 or 4).
        numel: number of values to return (at most ``packed.numel() * (8 // bits)``).

    Returns:
        1-D uint8 tensor of ``numel`` values.

    Raises:
        ValueError: packed is not 1-D uint8 or too short for ``numel``, or
            ``bits`` is not 1, 2 or 4.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or numel > (8 // bits) * packed.numel() or numel < 0:
        raise ValueError(f"bitfield_unpack: cannot unpack {numel} values from {packed.dtype}{tuple(packed.shape)}")
    fields = (packed.unsqueeze(1) >> _field_shifts(bits, packed.device)) & ((1 << bits) - 1)
    return fields.view(-1)[:numel]


def torch_bitmask_pack(x: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into ``ceil(n / 8)`` bytes, in memory order (aten reference).

    Args:
        x: a bool tensor: 1-D (any stride), or contiguous of any shape. A codec
            hands over the saved tensor itself where it is contiguous: under
            inductor, a view of it would be a second buffer for the op to read.

    Returns:
        1-D uint8 tensor of ``ceil(x.numel() / 8)`` bytes.

    Raises:
        ValueError: x is not bool, or has more than one dim and is not contiguous.
    """
    check_pack_args(x)
    return torch_bitfield_pack(x.reshape(-1).to(torch.uint8), 1)


def torch_bitmask_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`torch_bitmask_pack` (aten reference).

    Args:
        packed: 1-D uint8 tensor.
        numel: number of bools to return (at most ``8 * packed.numel()``).

    Returns:
        1-D bool tensor of ``numel`` elements.

    Raises:
        ValueError: packed is not 1-D uint8 or too short for ``numel``.
    """
    check_unpack_args(packed, numel)
    return torch_bitfield_unpack(packed, 1, numel) != 0


@torch.library.custom_op("savedhooks::bitmask_pack", mutates_args=())
def bitmask_pack(x: torch.Tensor) -> torch.Tensor:
    """``torch.ops.savedhooks.bitmask_pack``: see :func:`torch_bitmask_pack`."""
    return torch_bitmask_pack(x)


@bitmask_pack.register_fake
def _(x):
    return x.new_empty((x.numel() + 7) // 8, dtype=torch.uint8)


@torch.library.custom_op("savedhooks::bitmask_unpack", mutates_args=())
def bitmask_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """``torch.ops.savedhooks.bitmask_unpack``: see :func:`torch_bitmask_unpack`."""
    return torch_bitmask_unpack(packed, numel)


@bitmask_unpack.register_fake
def _(packed, numel):
    return packed.new_empty(numel, dtype=torch.bool)
