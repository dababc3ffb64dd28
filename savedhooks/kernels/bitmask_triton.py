"""Triton kernels for 1-bit packing of bool tensors, the same bytes as the aten reference.

Design notes
------------
* Layout as ``savedhooks.kernels.bitmask``: bit ``i`` of byte ``j`` is element
  ``8 * j + i``; the last byte is zero-padded.
* Pack: a program reads a ``(BYTES, 8)`` tile of bools (through a uint8 view) and
  sums the weighted bits per byte. Unpack: a program writes ``8 * BYTES`` bools,
  each reading its byte and shifting. Both stream; no reductions across programs.
* Ops, dispatch and tracing as the fp8 kernels (see ``triton_support``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from savedhooks.kernels.bitmask import bitmask_pack, bitmask_unpack, check_pack_args, check_unpack_args
from savedhooks.kernels.triton_support import as_triton_op, launch, runs_triton

__all__ = ["triton_bitmask_pack", "triton_bitmask_unpack"]

# Bytes per program: 2048 bytes pack 16 KiB of bools, a tile large enough to stream
# at bandwidth with 4 warps and small enough to keep several programs per SM.
_BYTES = 2048


@triton.jit
def bitmask_pack_kernel(x_ptr, out_ptr, n, n_bytes, BYTES: tl.constexpr):
    """Pack bools ``x_ptr[8j .. 8j+7]`` into byte ``out_ptr[j]`` for the program's BYTES bytes."""
    byte = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    index = byte.to(tl.int64)[:, None] * 8 + bit[None, :]
    bits = tl.load(x_ptr + index, mask=index < n, other=0).to(tl.int32)
    packed = tl.sum((bits != 0).to(tl.int32) << bit[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def bitmask_unpack_kernel(packed_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Write bools ``out_ptr[i] = bit i % 8 of packed_ptr[i // 8]`` for the program's BLOCK elements."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n
    byte = tl.load(packed_ptr + index // 8, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + index, ((byte >> (index % 8).to(tl.int32)) & 1).to(tl.uint8), mask=mask)


def triton_bitmask_pack(x: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into bytes (Triton; ``torch.ops.savedhooks.triton_bitmask_pack``).

    Same bytes as :func:`savedhooks.kernels.bitmask.torch_bitmask_pack`; runs the
    kernel on a GPU and under ``TRITON_INTERPRET=1``, else the aten reference.

    Args:
        x: a bool tensor: 1-D (any stride), or contiguous of any shape.

    Returns:
        1-D uint8 tensor of ``ceil(x.numel() / 8)`` bytes.

    Raises:
        ValueError: x is not bool, or has more than one dim and is not contiguous.
    """
    check_pack_args(x)
    if not runs_triton(bitmask_pack_kernel, x):
        return bitmask_pack(x)
    n = x.numel()
    out = torch.empty(triton.cdiv(n, 8), dtype=torch.uint8, device=x.device)
    if n:
        launch(bitmask_pack_kernel, (triton.cdiv(out.numel(), _BYTES),), x.contiguous().view(torch.uint8), out, n,
               out.numel(), BYTES=_BYTES)  # fmt: skip
    return out


triton_bitmask_pack = as_triton_op("savedhooks::triton_bitmask_pack", triton_bitmask_pack, bitmask_pack_kernel)


def triton_bitmask_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`triton_bitmask_pack` (``torch.ops.savedhooks.triton_bitmask_unpack``).

    Args:
        packed, numel: as :func:`savedhooks.kernels.bitmask.torch_bitmask_unpack`.

    Returns:
        The same bools as the reference.

    Raises:
        ValueError: as the reference.
    """
    check_unpack_args(packed, numel)
    if not runs_triton(bitmask_unpack_kernel, packed):
        return bitmask_unpack(packed, numel)
    out = torch.empty(numel, dtype=torch.bool, device=packed.device)
    if numel:
        launch(bitmask_unpack_kernel, (triton.cdiv(numel, 8 * _BYTES),), packed.contiguous(), out.view(torch.uint8),
               numel, BLOCK=8 * _BYTES)  # fmt: skip
    return out


triton_bitmask_unpack = as_triton_op("savedhooks::triton_bitmask_unpack", triton_bitmask_unpack, bitmask_unpack_kernel)
