"""Bool tensors packed 8 per byte: the aten reference and its ops.

Bit ``i`` of byte ``j`` holds element ``8 * j + i`` of the flattened tensor
(little-endian within a byte); the last byte is zero-padded.
"""

from __future__ import annotations

import torch

__all__ = ["torch_bitmask_pack", "torch_bitmask_unpack"]


def check_pack_args(x: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is a 1-D bool tensor (shared with the Triton op)."""
    if x.dtype != torch.bool or x.dim() != 1:
        raise ValueError(f"bitmask_pack expects a 1-D bool tensor, got {x.dtype}{tuple(x.shape)}")


def check_unpack_args(packed: torch.Tensor, numel: int) -> None:
    """Raise ValueError unless ``numel`` bools fit in the 1-D uint8 ``packed`` (shared with the Triton op)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or numel > 8 * packed.numel() or numel < 0:
        raise ValueError(f"bitmask_unpack: cannot unpack {numel} bools from {packed.dtype}{tuple(packed.shape)}")


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def torch_bitmask_pack(x: torch.Tensor) -> torch.Tensor:
    """Pack a contiguous 1-D bool tensor into ``ceil(n / 8)`` bytes (aten reference).

    Args:
        x: 1-D bool tensor.

    Returns:
        1-D uint8 tensor of ``ceil(x.numel() / 8)`` bytes.

    Raises:
        ValueError: x is not a 1-D bool tensor.
    """
    check_pack_args(x)
    n = x.numel()
    padded = torch.nn.functional.pad(x.to(torch.uint8), (0, -n % 8))
    # Distinct bits never carry, so a sum of weighted bits is an OR; uint8 sum stays uint8.
    return (padded.view(-1, 8) * _bit_weights(x.device)).sum(dim=1, dtype=torch.uint8)


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
    bits = (packed.unsqueeze(1) & _bit_weights(packed.device)) != 0
    return bits.view(-1)[:numel]


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
