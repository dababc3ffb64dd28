"""Lossless narrowing of max-pool indices: int64 values below the pooled plane's size in int16 or int32,
and inductor's int8 window offsets in 1, 2 or 4 bits.

Max pooling saves, for every output element, the flat index of its maximum in the
input plane (``h * W + w`` in 2-D). Those indices are int64 (8 bytes) but below
the plane's size, which the compiled graph knows: a 32 x 32 plane needs int16.

Under inductor, max pooling is decomposed into ``_low_memory_max_pool_with_offsets``,
and the partitioner saves its second output instead: the int8 offset of the maximum
inside the pooling window, below the window's size (4 for a 2 x 2 pool). Those fit
in ``ceil(log2(window))`` bits, rounded up to 1, 2 or 4 so that a byte holds whole
fields (``savedhooks.kernels.bitmask.torch_bitfield_pack``, aten ops that inductor
fuses into the pooling kernel): 2 bits for a 2 x 2 window, 4 bits for 3 x 3. Wider
windows keep their int8 offsets.

In eager mode there is no graph to read the plane or the window from, so the
indices are kept.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch

from savedhooks.codecs.base import Codec
from savedhooks.codecs.layout import Layout, from_rows, to_rows
from savedhooks.hooks import hook_context
from savedhooks.kernels.bitmask import FIELD_BITS, torch_bitfield_pack, torch_bitfield_unpack
from savedhooks.memory.graph import producing_op

__all__ = ["PoolIndices", "offset_bits", "pool_plane"]

_OFFSETS_OP = "_low_memory_max_pool_with_offsets"

# op -> how many trailing dims of its input make the plane its indices count in
_POOL_DIMS = {
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
}


def pool_plane(node: torch.fx.Node) -> int | None:
    """Size of the plane that a saved max-pool index tensor indexes into.

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        The number of elements of one pooled input plane (``H * W`` in 2-D), or
        None when ``node`` is not the indices output of a max pool with a static
        input shape.
    """
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return None
    pool = node.args[0]
    dims = _POOL_DIMS.get(producing_op(pool) or "")
    val = pool.args[0].meta.get("val") if pool.args and isinstance(pool.args[0], torch.fx.Node) else None
    if dims is None or not isinstance(val, torch.Tensor):
        return None
    sizes = val.shape[-dims:]
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else None


def offset_bits(node: torch.fx.Node) -> int | None:
    """Bits per value that a saved inductor max-pool offset tensor packs into.

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        1, 2 or 4: the fewest of those that hold every offset below the pooling
        window's size; None when ``node`` is not the offsets output of
        ``_low_memory_max_pool_with_offsets`` with a static window of at most 16.
    """
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return None
    pool = node.args[0]
    if producing_op(pool) != _OFFSETS_OP or len(pool.args) < 2:
        return None
    kernel = pool.args[1]
    if not all(isinstance(k, int) for k in kernel):
        return None
    window = math.prod(kernel)
    return next((bits for bits in FIELD_BITS if window <= 1 << bits), None)


def _is_pool_offsets(x: torch.Tensor) -> bool:
    ctx = hook_context()
    return x.dtype == torch.int8 and x.numel() > 0 and ctx is not None and offset_bits(ctx.node) is not None


@dataclasses.dataclass(frozen=True)
class PoolIndices(Codec):
    """Max-pool indices narrowed to int16 or int32, inductor's pool offsets packed to bits, under compile.

    Lossless; see the module notes.
    """

    @property
    def lossy(self) -> bool:
        """False: decoding returns the packed values bit for bit."""
        return False

    def accepts(self, x: torch.Tensor) -> bool:
        """int64 indices of a max pool whose plane fits int32, or int8 offsets of a window of at most 16, under compile."""
        if _is_pool_offsets(x):
            return True
        ctx = hook_context()
        plane = pool_plane(ctx.node) if ctx is not None and x.dtype == torch.int64 else None
        return plane is not None and plane <= 2**31

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(x in int16 or int32,)`` for indices; ``(fields, bits, layout)`` for offsets (``8 / bits`` per byte)."""
        node = hook_context().node
        if _is_pool_offsets(x):
            bits = offset_bits(node)
            rows, layout = to_rows(x)
            return torch_bitfield_pack(rows.reshape(-1).to(torch.uint8), bits), bits, layout.as_constants()
        plane = pool_plane(node)
        return (x.to(torch.int16 if plane <= 2**15 else torch.int32),)

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Widen indices back to int64; unpack offsets to int8 with the saved shape and strides."""
        if len(payload) == 1:
            return payload[0].to(torch.int64)
        fields, bits, constants = payload
        layout = Layout.from_constants(constants)
        flat = torch_bitfield_unpack(fields, bits, math.prod(layout.shape))
        return from_rows(flat.to(torch.int8).view(1, -1), layout)
